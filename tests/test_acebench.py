"""ACEBench's agent categories (evaluate.ACEBench): our sandbox against the end states the authors' own sandbox gives
for the gold calls (tests/acebench, offline), the call parser, the checker's rules, the loop's ends, and, where
ACEBench's data is here (../shared/acebench or $MUA_ACEBENCH_DIR), the gold replays at 30/30 and 20/20 with each
repaired milestone named and shown necessary, and the negative controls."""

import json
import os
from pathlib import Path

import pytest

import evaluate
from acebench_fixtures import MS, REPAIRS, gold_calls
from evaluate import ACEBench, ace_check, ace_decode, ace_process
from rollout import TINY_BASE as TINY, TextAgents, run_episodes

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("MUA_ACEBENCH_DIR") or REPO.parent / "shared" / "acebench")
FIXTURE = json.loads((REPO / "tests" / "acebench" / "gold_end_states.json").read_text())
STRIP_NEEDED = {  # a trailing space in a milestone: ACEBench's decoder refuses the message, which then changes nothing
    "multi_turn": {"agent_multi_turn_4", "agent_multi_turn_6"},  # it goes to the replaying user, who ends it
    "multi_step": {f"agent_multi_step_{i}" for i in range(6, 12)}}
UNNEEDED = {  # REPAIRS rows whose entries pass without them (the repair keeps the replay what it says it is)
    2: MS[0:2], 3: MS[0:2],  # the reminder's quotes: the answer misspells ReminderApi, so nothing checks it
    7: MS[14:18]}  # the id lookup changes no state: the deletion of message 4 (row 8) is what the answer checks
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"ACEBench's data not at {DATA} (set MUA_ACEBENCH_DIR)")


def data_world(category):
    """The category's world on the data folder; a folder in a layout or format the loader does not read skips, with
    the loader's one line (it was written without sight of ../shared/acebench)."""
    try:
        return ACEBench(category, DATA, user="gold")
    except SystemExit as e:
        pytest.skip(f"ACEBench data at {DATA} not read: {e}")


class GoldAgent:
    """Says the entry's gold calls, one message each, then 'finish conversation'."""

    def __init__(self, calls):
        self.todo = list(calls)

    def act(self, messages):
        return self.todo.pop(0) if self.todo else "finish conversation"


def play(category, tasks, calls_of, user="gold"):
    world = ACEBench(category, tasks=tasks, user=user)
    agent = TextAgents(lambda task, seed: GoldAgent(calls_of(task)))
    eps = run_episodes(agent, world, tasks)
    for ep, t in zip(eps, tasks):
        world.score(ep, t) if "answer" in t else None
    return world, eps


def fixture_tasks(category):
    """The fixture's entries as tasks (no answer: the state alone is compared)."""
    return [{"id": k, "kind": category, "entry": {"id": k, "question": "Please help me.", "function": [], **{
        f: v[f] for f in ("involved_classes", "initial_config")}}} for k, v in FIXTURE.items() if category in k]


@pytest.mark.parametrize("category", evaluate.ACE_CATEGORIES)
def test_end_states_equal_the_authors_sandbox(category):
    """Per entry, our sandbox's end state and executed messages after the gold calls equal the authors' (fixture)."""
    tasks = fixture_tasks(category)
    assert len(tasks) == {"multi_turn": 30, "multi_step": 20}[category]
    _, eps = play(category, tasks, lambda t: FIXTURE[t["id"]]["calls"])
    for ep, t in zip(eps, tasks):
        want = FIXTURE[t["id"]]
        assert evaluate.ace_end_state(ep.state) == want["end_state"], t["id"]
        assert [m["ace"] for m in ep.messages if "ace" in m] == want["executed"], t["id"]
        assert ep.end_reason == {"multi_turn": "finish", "multi_step": "agent_stop"}[category], t["id"]
    # negative control: one call fewer leaves another state
    _, short = play(category, tasks[:1], lambda t: FIXTURE[t["id"]]["calls"][:-1])
    assert evaluate.ace_end_state(short[0].state) != FIXTURE[tasks[0]["id"]]["end_state"]


def test_parser_takes_literal_calls_only():
    assert ace_decode("[send_message(sender_name='Eve', receiver_name=\"Frank\", message='hi')]") == [
        ("send_message", {"sender_name": "Eve", "receiver_name": "Frank", "message": "hi"})]
    assert ace_decode("[f(a=[{'p': 'x', 'q': -2}], b=(1, 2.5), c=None, d=True), g()]") == [
        ("f", {"a": [{"p": "x", "q": -2}], "b": (1, 2.5), "c": None, "d": True}), ("g", {})]
    assert ace_decode(" f(a=x, b=1)") == [("f", {"a": "x", "b": 1})]  # brackets added; a bare name is its string
    assert ace_decode("[f('dropped', a=1)]") == [("f", {"a": 1})]  # positional arguments dropped, as ACEBench does
    for bad in ["[f(a=__import__('os').system('true'))]", "[f(a=1+1)]", "[f(a=lambda: 1)]", "[f(a=x[0])]",
                "[f(a=x.y)]", "[f(**{'a': 1})]", "[f(a={**d})]", "[f(a=-x)]", "[f(a=1), 2]", "Sure! [f()]",
                "[f(a='it's')]", "[f() ] ", "[]", "", "finish", "[f(a='x')] trailing", "[f(a={})]", "[f(a={'b': 1})]"]:
        assert ace_decode(bad) is None, bad
    assert ace_decode("[f(a=1), 2]", strict=False) == [("f", {"a": 1})]  # the execution role skips non-calls


def test_calls_run_on_every_instance_and_fail_as_acebench_does():
    entry = {"id": "x", "question": "q", "function": [], "involved_classes": ["BaseApi", "MessageApi", "ReminderApi"],
             "initial_config": {"BaseApi": {"wifi": False, "logged_in": False}}}
    for category in evaluate.ACE_CATEGORIES:
        world = ACEBench(category, tasks=[{"id": "x", "kind": category, "entry": entry}])
        state = world.reset(world.tasks[0])
        assert [vars(i)["logged_in"] for i in state.instances.values()] == [False] * 3
        run = lambda text: world.call_all([(state, c["function"]["name"], c["function"]["arguments"], "agent")  # noqa
                                           for c in world.parse(text)["tool_calls"]])
        assert run("[login_device()]") == [('{"status": true, "message": "Device has been logged in"}', False)]
        assert [vars(i)["logged_in"] for i in state.instances.values()] == [True] * 3  # every instance with it
        out = run("[get_latest_message_id(), no_such(), delete_message(message_id=1, x=2), turn_on_wifi()]")
        if category == "multi_step":  # each call alone; an unknown name repeats the last result (stale variable)
            assert out[1] == out[0] and out[2][1] and out[2][0].startswith("Error during execution: ") and \
                "unexpected keyword argument 'x'" in out[2][0] and not out[3][1]
            assert state.instances["BaseApi"].wifi is True
        else:  # the message stops at the error and all of it gets ACEBench's unformatted error text
            assert out == [("Error during execution: {str(e)}", True)] * 4
            assert state.instances["BaseApi"].wifi is False
        assert run("[no_such()]")[0][0].startswith("Error during execution: ")


def test_the_checker_rules():
    right = [{"BaseApi": {"wifi": True, "logged_in": True}}, {"MessageApi": {"inbox": {"1": {"m": "a"}}}}]
    assert ace_check(right, right) == (True, [])
    extra = [right[0], {"MessageApi": {"inbox": {"1": {"m": "a"}, "9": {"m": "z"}}}}]
    assert ace_check(extra, right)[0]  # a dict attribute is checked on the answer's keys only
    assert not ace_check([right[0], {"MessageApi": {"inbox": {"1": {"m": "b"}}}}], right)[0]
    assert ace_check(right[:1], right) == (False, ["wrong number of class"])
    assert ace_check([], right)[0] is False  # no message ran: nothing recorded
    typo = [right[0], {"MessageAPI": {"inbox": {}}}]
    assert ace_check(right, typo)[0]  # an answer class named as no class is not checked (ACEBench's rule)
    assert ace_process(["[a()]", "[x()]", "[b()] "], ["[a()]", "[b()]", "[c()]"]) == 0.667
    assert ace_process(["[b()]", "[a()]"], [["[a()]", "[b()]"], ["[b()]"]]) == 1.0  # the best of several lists


def test_the_loop_ends_as_acebench_does():
    """multi_step has no user: the question opens it, a plain text is answered by the execution role, 'finish
    conversation' ends it; 40 messages end it where nothing else does."""
    entry = {"id": "x", "question": "Turn on the wifi.", "function": [], "involved_classes": ["BaseApi"],
             "initial_config": {}}
    task = {"id": "x", "kind": "multi_step", "entry": entry}
    world, eps = play("multi_step", [task], lambda t: ["What should I do?", "[turn_on_wifi()]"])
    ep = eps[0]
    assert world.user(task, ep.state, 0) is None and ep.messages[1] == {"role": "user", "content": entry["question"]}
    assert ep.messages[3]["content"] == evaluate.ACE_ASK and ep.end_reason == "agent_stop"  # no user to answer
    assert [m["ace"] for m in ep.messages if "ace" in m] == ["What should I do?", "[turn_on_wifi()]"]
    _, eps = play("multi_step", [task], lambda t: ["[turn_on_wifi()]"] * 30)
    assert eps[0].end_reason == "max_messages" and eps[0].turns == 20  # 20 calls, 20 execution answers


@needs_data
@pytest.mark.parametrize("category", evaluate.ACE_CATEGORIES)
def test_gold_replay_passes_every_entry(category):
    """The repaired gold replay passes 30/30 and 20/20 by ACEBench's checker with process accuracy 1; the summary
    says so; each repair is needed (the entry fails without it); dropping the last call, or a wrong argument, fails."""
    world = data_world(category)
    tasks = world.tasks
    assert len(tasks) == {"multi_turn": 30, "multi_step": 20}[category]
    _, eps = play(category, tasks, lambda t: gold_calls(t["id"], t["answer"]["mile_stone"]))
    assert [t["id"] for ep, t in zip(eps, tasks) if ep.reward != 1.0] == []
    assert world.summary(eps) == {"end_to_end_accuracy": 1.0, "process_accuracy": 1.0}
    for ep, t in zip(eps, tasks):  # the same end state as the authors' sandbox, from the data's own entries
        assert evaluate.ace_end_state(ep.state) == FIXTURE[t["id"]]["end_state"], t["id"]
    # each repair is needed: without it, the entries it repairs fail, but where named in UNNEEDED; stripping is
    # needed where named in STRIP_NEEDED
    for r, (ids, how, what, into, why) in enumerate(REPAIRS):
        mine = [t for t in tasks if t["id"] in ids]
        _, without = play(category, mine, lambda t: gold_calls(t["id"], t["answer"]["mile_stone"], skip=r))
        passing = {t["id"] for ep, t in zip(without, mine) if ep.reward == 1.0}
        assert passing == set(UNNEEDED.get(r, [])) & {t["id"] for t in mine}, (r, why)
    _, unstripped = play(category, tasks, lambda t: gold_calls(t["id"], t["answer"]["mile_stone"], strip=False))
    assert {t["id"] for ep, t in zip(unstripped, tasks) if ep.reward != 1.0} == STRIP_NEEDED[category]
    # negative controls: the last call dropped, or its first string argument wrong, fail; but where the answer
    # misspells the last call's class (ACEBench's checker then never checks it)
    unchecked = {"agent_multi_turn_7", "agent_multi_step_0", "agent_multi_step_1"}  # Reminderpi, ReminderAPI
    _, dropped = play(category, tasks, lambda t: gold_calls(t["id"], t["answer"]["mile_stone"])[:-1])
    assert {t["id"] for ep, t in zip(dropped, tasks) if ep.reward != 0.0} == unchecked & {t["id"] for t in tasks}

    def wrong(t):
        calls = gold_calls(t["id"], t["answer"]["mile_stone"])
        name, args = ace_decode(calls[-1])[-1]
        k = next(k for k, v in args.items() if isinstance(v, str))
        return calls[:-1] + [evaluate.ace_render([(name, {**args, k: args[k] + " (wrong)"})])]
    _, wrongs = play(category, tasks, wrong)
    assert {t["id"] for ep, t in zip(wrongs, tasks) if ep.reward != 0.0} == unchecked & {t["id"] for t in tasks}
    assert {k: v for t in tasks for x in t["answer"]["ground_truth"] for k, v in x.items()
            if k not in evaluate.ACE_SAVED and t["id"] in unchecked}  # the misspelled classes are there


@needs_data
def test_shared_default_states_equal_the_constructors():
    """../shared's default_states.json (where it has one) holds what the authors' constructors build (our copy)."""
    hits = sorted(DATA.rglob(evaluate.ACE_STATES))
    if not hits:
        pytest.skip(f"no {evaluate.ACE_STATES} under {DATA}: the committed copy is used")
    try:
        shared = evaluate.ace_default_states(DATA)
    except SystemExit as e:
        pytest.skip(f"{hits[0]} not read: {e}")
    assert shared == evaluate.ace_default_states(REPO / "tests" / "no_such_folder")


class FakeChat:
    """An OpenAI-compatible user endpoint's stand-in: says `replies` in order, and keeps what it was sent."""

    def __init__(self, replies):
        self.replies, self.seen = list(replies), []

    def chat(self, batch, max_new_tokens, temperature, seeds, tools=None):
        self.seen += batch
        return [self.replies.pop(0) for _ in batch]


def test_an_llm_user_plays_multi_turn():
    """multi_turn's user is an LLM (any chat backend): told ACEBench's rules and the question, its 'finish
    conversation' ends the entry; the agent's calls between its words change the state as the authors' do."""
    task = fixture_tasks("multi_turn")[0]
    task = {**task, "user_scenario": {"instructions": "You are Grace; send Frank a lunch invitation."}}
    user = FakeChat(["Please send Frank a message for me.", "I am Grace.", "Thanks. finish conversation"])
    world = ACEBench("multi_turn", tasks=[task], user=user)
    calls = ["Sure, who sends it?"] + FIXTURE[task["id"]]["calls"]
    eps = run_episodes(TextAgents(lambda t, seed: GoldAgent(calls)), world, [task])
    ep = eps[0]
    assert "finish conversation" in user.seen[0][0]["content"] and "lunch invitation" in user.seen[0][0]["content"]
    assert ep.messages[1] == {"role": "user", "content": "Please send Frank a message for me."}
    assert ep.end_reason == "finish" and evaluate.ace_end_state(ep.state) == FIXTURE[task["id"]]["end_state"]
    with pytest.raises(SystemExit, match="needs an LLM user"):
        ACEBench("multi_turn", tasks=[task]).user(task, ep.state, 0)


@pytest.mark.slow  # loads the tiny model: about 10 s
def test_evaluate_runs_acebench(tmp_path):
    """evaluate.py --bench acebench on a data folder in ACEBench's layout (one entry per category, its answer the
    fixture's end state): both worlds run and report ACEBench's two figures; a missing file fails in one line."""
    data = tmp_path / "ACEBench" / "data_all" / "data_en"
    (data / "possible_answer").mkdir(parents=True)
    for category in evaluate.ACE_CATEGORIES:
        key = f"agent_{category}_3"
        entry = {"id": key, "question": "Do it.", "function": [], "path": [],
                 **{f: FIXTURE[key][f] for f in ("involved_classes", "initial_config")}}
        answer = {"id": key, "ground_truth": FIXTURE[key]["end_state"], "mile_stone": FIXTURE[key]["calls"]}
        (data / f"data_agent_{category}.json").write_text(json.dumps(entry) + "\n")
        (data / "possible_answer" / f"data_agent_{category}.json").write_text(json.dumps(answer) + "\n")
    out = evaluate.main(["--bench", "acebench", "--acebench-dir", str(tmp_path), "--models", f"base={TINY}",
                         "--user", "gold", "--max-new-tokens", "8", "--out", str(tmp_path / "out")])
    for category in evaluate.ACE_CATEGORIES:
        s = out["base"][f"acebench_{category}"]
        assert s["all"]["n"] == 1 and set(s["figures"]) == {"end_to_end_accuracy", "process_accuracy"}
    (data / "possible_answer" / "data_agent_multi_step.json").unlink()
    with pytest.raises(SystemExit, match="possible_answer/data_agent_multi_step.json not found"):
        evaluate.ACEBench("multi_step", tmp_path)
