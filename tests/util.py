"""Helpers shared by the test files (tests/ is on sys.path: pytest puts it there, it has no __init__.py)."""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"  # tau2-bench's retail data, where ../shared has it


def sub_env():
    """Environment for child processes: offline, one thread each, the repo importable."""
    e = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeOpenAIServer:
    """An HTTP server on 127.0.0.1 for OpenAI-compatible clients; `url` ends in /v1.

    Every POST's JSON body goes to `answer(path, body)`, which subclasses define and which returns
    (HTTP status, JSON-able object): the status and object are sent back as the response."""

    def __init__(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, obj = outer.answer(self.path, body)
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout): fine
                    pass

            def log_message(self, *a):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 1024  # the default listen backlog (5) drops connections of a large batch

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def answer(self, path, body):
        raise NotImplementedError

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def check_torchrun(r):
    """Skip when gloo cannot come up on this machine (its fault, not the code's); otherwise require success."""
    import pytest
    no_net = ("EADDRINUSE", "Address already in use", "Connection refused", "getaddrinfo", "Network is unreachable",
              "Cannot assign requested address", "RendezvousConnectionError")
    if r.returncode != 0 and any(s in r.stderr for s in no_net):
        pytest.skip(f"gloo/torchrun cannot connect on this machine: {r.stderr[-600:]}")
    assert r.returncode == 0, r.stderr[-3000:]


def cli_args(**over):
    """Keyword overrides -> a script's command-line flags: --snake-case VALUE; a list gives several values;
    True gives the bare flag; False and None are left out (the parser's default)."""
    argv = []
    for k, v in over.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is False or v is None:
            continue
        elif isinstance(v, (list, tuple)):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv


def run_main(module, **over):
    """Run a stage in-process exactly as its command line would: module.main(flags)."""
    return module.main(cli_args(**over))


def main_defaults(module, entry):
    """The keyword arguments module.main hands to module.<entry> when given no flags (the parser's defaults), or
    the parsed flags it hands over as one namespace. Run from an empty folder: main checks its default --out (a
    checkout with an earlier out/grpo would refuse)."""
    import tempfile
    from unittest import mock
    seen, here = {}, os.getcwd()
    record = lambda *a, **kw: seen.update(vars(a[0]) if a else kw)  # noqa: E731
    with tempfile.TemporaryDirectory() as empty, mock.patch.object(module, entry, record):
        os.chdir(empty)
        try:
            module.main([])
        finally:
            os.chdir(here)
    return seen


class FakeServer(FakeOpenAIServer):
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


def run_py(*argv, timeout=90):
    r = subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, env=sub_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{argv[:1]} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r


# an inline task in tau2's shape, for LLM-user tests
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


def backend_for(srv, **kw):
    kw = {"timeout": 5, "max_retries": 2, "backoff": 0.01, **kw}
    from rollout import OpenAIChatBackend
    return OpenAIChatBackend(srv.url, "fake-user-model", **kw)


class FakeLLM:
    """Stands in for vllm.LLM: records the engine's options, each generate call's SamplingParams and the calls
    around a weight push; generate answers every prompt with its stop token (an immediate end of turn)."""

    events, made = [], []  # every engine's start and shutdown in order, every engine's options (reset by
    # fake_vllm_module)

    def __init__(self, **kw):
        from types import SimpleNamespace
        self.kw, self.calls, self.params = kw, [], []
        FakeLLM.events.append(("start", kw.get("model")))
        FakeLLM.made.append(kw)
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(
            shutdown=lambda: FakeLLM.events.append(("shutdown", kw.get("model")))))

    def generate(self, prompts, params, use_tqdm=True):
        from types import SimpleNamespace
        self.params.append(params)
        out = []
        for p in params:
            eot = p.stop_token_ids[0]
            c = SimpleNamespace(token_ids=[eot], logprobs=[{eot: SimpleNamespace(logprob=-0.5)}])
            out.append(SimpleNamespace(outputs=[c]))
        return out

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append((method, [(n, t.dtype) for n, t in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def fake_vllm_module():
    """A `vllm` module with FakeLLM, for sys.modules: SamplingParams keeps its keyword arguments as attributes."""
    from types import SimpleNamespace
    FakeLLM.events, FakeLLM.made = [], []
    return SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: SimpleNamespace(**kw),
                           TokensPrompt=lambda prompt_token_ids: prompt_token_ids)


# ----------------------------------------------------------------------------------------------------
# the generated shop played by the oracle against the scripted user (tests/conftest.py has the fixtures)

PER_KIND = 5  # tasks of each kind from each split in the oracle sweep


def by_kind(tasks):
    out = {}
    for t in tasks:
        out.setdefault(t["kind"], []).append(t)
    return out


def scripted(t, s):
    import env
    return env.ScriptedUser(t, s)


def oracle(t, s):
    import synth
    return synth.OracleAgent(t, s)


def play(tasks, db, make_agent=oracle, seed=0, basis="db", **world_kw):
    """Text agents from make_agent play `tasks` on the shop `db` with the scripted user; scored on `basis`."""
    import env
    import rollout
    world = env.Shop(db, **world_kw)
    return scored(world, rollout.run_episodes(rollout.TextAgents(make_agent), world, tasks, seed=seed), tasks, basis)


def shop(db=None, user=None, **world_kw):
    """env.Shop on `db` (default: an empty shop) whose users come from user(task, seed) where given."""
    import env

    class TestShop(env.Shop):
        def own_user(self, task, state, seed):
            return user(task, seed) if user else super().own_user(task, state, seed)
    return TestShop(db or {"products": {}, "users": {}, "orders": {}}, **world_kw)


def scored(world, eps, tasks, basis="db"):
    """Each episode that did not error, scored by the world (run_episodes leaves scoring to its caller)."""
    for ep, task in zip(eps, tasks):
        if not ep.errored:
            world.score(ep, task, basis)
    return eps


def user_texts(ep):
    return [m["content"] for m in ep.messages if m["role"] == "user"]


def writes(ep):
    """(name, arguments) of every write the agent called, in order."""
    import env
    return [(c["function"]["name"], c["function"]["arguments"]) for m in ep.messages if m["role"] == "assistant"
            for c in m.get("tool_calls", []) if c["function"]["name"] in env.WRITE_TOOLS]


class FakeUser(FakeOpenAIServer):
    """An OpenAI-compatible user model: asks for help once, then stops."""

    def answer(self, path, body):
        said = sum(m["role"] == "assistant" for m in body["messages"])  # its own earlier lines
        text = "Hi, I want to return an order." if said == 0 else "Thanks. ###STOP###"
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


class DeadEndpoints:
    """Stands in for rollout.OpenAIChatBackend (monkeypatch it in): `made` records each endpoint's URL and the
    concurrency it was built with; every request fails at once, so a run ends quickly with every episode errored."""

    def __init__(self):
        self.made = []
        outer = self

        class Backend:
            def __init__(self, base_url, model, concurrency=None, **kw):
                outer.made.append((base_url, concurrency))

            def chat(self, batch, *a, **kw):
                import env
                return [env.UserSimError("dead endpoint")] * len(batch)
        self.Backend = Backend
