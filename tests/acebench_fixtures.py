"""ACEBench's gold replay (the milestones as the agent's messages, repaired where they are broken) and the builder
of the fixtures in tests/acebench from the authors' own code, run once outside the project:

    git clone https://github.com/chenchen0103/ACEBench /tmp/acebench_src   # at 56dd66c
    python tests/acebench_fixtures.py --authors /tmp/acebench_src
    python tests/acebench_fixtures.py --authors /tmp/acebench_src --differential 40   # both sandboxes compared

writes tests/acebench/default_states.json (each sandbox class's state at construction), gold_end_states.json (per
entry, the end state and executed messages the authors' sandbox gives for the repaired gold replay, through their
decoder and execution role) and provenance.json. Their modules are imported from --authors; none is copied here."""
import argparse
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent / "acebench"
MT = [f"agent_multi_turn_{i}" for i in range(30)]
MS = [f"agent_multi_step_{i}" for i in range(20)]
FOOD_LOGIN = "[login_food_platform(username='Helen', password='password321')]"
MOST_RECENT = "the question says to delete the most recent message (the answer deletes message 4)"
REPAIRS = [  # (entries, how, what, into, why); every milestone is also stripped (see gold_calls)
    (MT[8:16] + MS[0:2], "sub", "'Domino's'", '"Domino\'s"', "an unescaped quote: not a call"),
    (MS[0:2], "sub", "'Super Supreme'", "'Super Supreme Pizza'", "no such product: the order fails"),
    (MS[0:2], "sub", "'Today's spending'", '"Today\'s spending"', "an unescaped quote: not a call"),
    (MS[0:2], "sub", "'Today's spending 88.0 yuan'", '"Today\'s spending 88.0 yuan"', "an unescaped quote"),
    (MS[4:6], "sub", "'Don't forget tomorrow afternoon's meeting'", '"Don\'t forget tomorrow afternoon\'s meeting"',
     "an unescaped quote: not a call"),
    (MT[6:7] + MS[16:17], "first", "", "[login_device()]", "the device starts logged out; no milestone logs in"),
    (MS[12:14], "before", "[add_food_delivery_order", FOOD_LOGIN, "the order needs a login no milestone makes"),
    (MS[14:18], "sub", "[get_earliest_message_id()]", "[get_latest_message_id()]", MOST_RECENT),
    (MS[14:18], "sub", "[delete_message(message_id=3)]", "[delete_message(message_id=4)]", MOST_RECENT),
]

def gold_calls(entry_id, milestones, skip=None, strip=True):
    """An entry's gold agent messages: its (first) milestone list, each stripped (ACEBench's decoder refuses a
    message with a trailing space; its checker strips them), with the entry's repairs applied (but REPAIRS[skip])."""
    calls = [m.strip() if strip else m for m in (milestones[0] if milestones and isinstance(milestones[0], list)
                                                 else milestones)]
    for r, (ids, how, what, into, _) in enumerate(REPAIRS):
        if entry_id not in ids or r == skip:
            continue
        if how == "sub":
            calls = [c.replace(what, into) for c in calls]
        elif how == "first":
            calls = [into] + calls
        else:
            i = next(i for i, c in enumerate(calls) if c.startswith(what))
            calls = calls[:i] + [into] + calls[i:]
    return calls

def authors_modules(root):
    """The authors' execution roles and saved attributes, imported from their checkout (stubs for the packages
    their inference modules import but these pieces never use)."""
    sys.path.insert(0, str(root))
    for m in [m for m in ["openai", "dotenv", "tqdm", "wcwidth"] if importlib.util.find_spec(m) is None]:
        mod = types.ModuleType(m)
        mod.OpenAI, mod.load_dotenv, mod.tqdm, mod.wcswidth = object, (lambda *a, **k: None), None, len
        sys.modules.setdefault(m, mod)
    from model_inference.apimodel_inference import SAVED_CLASS
    from model_inference.multi_step.execution_role_step import EXECUTION_STEP
    from model_inference.multi_turn.APIModel_agent import APIAgent_turn
    from model_inference.multi_turn.execution_role import EXECUTION
    from model_inference.multi_turn.scenariosen import travel
    from model_inference.multi_turn.scenariosen.phone_platform import base_api, food_services, message, reminder
    classes = [base_api.BaseApi, message.MessageApi, reminder.ReminderApi, food_services.FoodPlatform, travel.Travel]
    return SAVED_CLASS, EXECUTION, EXECUTION_STEP, APIAgent_turn, classes

def replay(entry, calls, category, mods):
    """The authors' loop with an agent that says `calls`: multi_turn executes what its agent would route to
    execution; multi_step executes every message. -> (end state as read back from a result file, executed)."""
    saved, execution, execution_step, agent_turn, _ = mods
    test_id = entry["id"].split("_")[-1]
    role = (execution if category == "multi_turn" else execution_step)(
        "gold", entry["initial_config"], entry["involved_classes"], test_id, "en")
    instances, executed, answers = [], [], []
    for c in calls:
        if category == "multi_turn":
            try:
                object.__new__(agent_turn).decode_function_list(c)
            except Exception:  # noqa: BLE001 - its agent sends such a text to the user
                answers.append(None)
                continue
        executed.append(c)
        with contextlib.redirect_stdout(io.StringIO()):  # their sandbox prints
            msg, inst = role.respond([{"message": c}])
        answers.append(msg["message"])
        if isinstance(inst, dict) and inst and inst not in instances:
            instances.append(inst)
    state = [{n: {k: v for k, v in vars(i).items() if k in saved[n]}} for d in instances for n, i in d.items()]
    return json.loads(json.dumps(state, ensure_ascii=False, default=str)), executed, answers

def as_json(text):
    """A result as the authors' execution role passes it on: JSON where it parses, else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text

def differential(root, mods, n, seed=0):
    """n random call messages per entry (gold calls, and calls of its functions with arguments drawn from a pool of
    the data's values and wrong types) through the authors' execution roles and through evaluate.ACEBench's: each
    message's answers and the end state compared. -> the number of entries whose sequence differed."""
    import random
    import rollout
    from evaluate import ACE_ASK, ACEBench, ace_end_state, ace_render
    rng, bad = random.Random(seed), 0
    pool = ["Eve", "Frank", "Grace", "Helen", "Isaac", "password123", "password654", "user1", "user2", "user3",
            "res_1", "res_2", "CA1234", "CZ4352", "MU3561", "CZ1765", "Economy Class", "Business Class", "cash",
            "bank", "Beijing", "Shanghai", "Nanjing", "Shenzhen", "Domino's", "Heytea", "Hema Fresh", "To-do list",
            "call", "The airline has canceled the flight.", 1, 3, 4, 7, 0, -1, 2.5, True, None, [], {},
            [{"product": "Fresh Gift Pack", "quantity": 2}], [{"product": "Margherita Pizza"}], "2024-06-11 16:00"]
    for cat in ["multi_turn", "multi_step"]:
        data_dir = root / "data_all" / "data_en"
        entries = [json.loads(x) for x in open(data_dir / f"data_agent_{cat}.json")]
        answers = {x["id"]: x for x in map(json.loads, open(data_dir / f"possible_answer/data_agent_{cat}.json"))}
        world = ACEBench(cat, tasks=[{"id": e["id"], "kind": cat, "entry": e} for e in entries])
        for e in entries:
            gold, names = gold_calls(e["id"], answers[e["id"]]["mile_stone"]), [f["name"] for f in e["function"]]
            docs = {f["name"]: list(f["parameters"]["properties"]) for f in e["function"]}
            msgs = [rng.choice(gold) if rng.random() < 0.4 else ace_render([
                (name, {k: rng.choice(pool) for k in docs.get(name, []) + ["bogus"] * (rng.random() < 0.1)
                        if rng.random() < 0.8})
                for name in rng.choices(names + ["no_such"], k=rng.choice([1, 1, 2, 3]))]) for _ in range(n)]
            e = {**e, "id": f"{e['id']}x{rng.randrange(10**9)}"}  # the authors' instances are globals, keyed by id
            state, _, theirs = replay(e, msgs, cat, mods)
            theirs = ["".join(t) if isinstance(t, list) and t and all(isinstance(c, str) and len(c) == 1 for c in t)
                      else [t] if t == ACE_ASK else t for t in theirs]  # multi_turn's error arrives as characters
            ours, sandbox = [], world.reset({"entry": e})
            for m in msgs:
                msg = world.parse(m)
                got = [c for _, c, _ in rollout.execute_calls(world, [(sandbox, msg)])[0]] if msg.get("tool_calls") \
                    else None
                ours.append(got[0] if got and got[0] == "Error during execution: {str(e)}" else
                            [as_json(c) for c in got] if got else got)
            if ours != theirs or ace_end_state(sandbox) != state:
                bad += 1
                print(f"differs: {e['id']}", file=sys.stderr)
    return bad

def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--authors", required=True, help="a checkout of chenchen0103/ACEBench")
    p.add_argument("--differential", type=int, default=0, help="instead: this many random messages per entry through "
                                                                "both sandboxes, compared (exit 1 if any differ)")
    a = p.parse_args()
    root = Path(a.authors).resolve()
    mods = authors_modules(root)
    if a.differential:
        sys.path.insert(0, str(HERE.parent.parent))
        bad = differential(root, mods, a.differential)
        print(f"{bad} of 50 entries differ over {a.differential} random messages each", file=sys.stderr)
        sys.exit(1 if bad else 0)
    defaults = {c.__name__: vars(c()) for c in mods[4]}
    (HERE / "default_states.json").write_text(json.dumps(defaults, indent=1, ensure_ascii=False) + "\n")
    out = {}
    for cat in ["multi_turn", "multi_step"]:
        data_dir = root / "data_all" / "data_en"
        entries = [json.loads(x) for x in open(data_dir / f"data_agent_{cat}.json")]
        answers = {x["id"]: x for x in map(json.loads, open(data_dir / f"possible_answer/data_agent_{cat}.json"))}
        for e in entries:
            state, executed, _ = replay(e, gold_calls(e["id"], answers[e["id"]]["mile_stone"]), cat, mods)
            out[e["id"]] = {"involved_classes": e["involved_classes"], "initial_config": e["initial_config"],
                            "calls": gold_calls(e["id"], answers[e["id"]]["mile_stone"]), "executed": executed,
                            "end_state": state}
    with open(HERE / "gold_end_states.json", "w") as f:
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in out.items())
                + "\n}\n")
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    (HERE / "provenance.json").write_text(json.dumps({
        "repo": "https://github.com/chenchen0103/ACEBench", "commit": commit.strip(), "python": sys.version.split()[0],
        "command": "python tests/acebench_fixtures.py --authors <checkout>",
        "default_states.json": "vars() of each class of model_inference/multi_turn/scenariosen at construction",
        "gold_end_states.json": "per English agent entry, the authors' execution role (multi_turn: EXECUTION behind "
                                "APIAgent_turn's decoder; multi_step: EXECUTION_STEP) run on gold_calls(); the end "
                                "state as their inference saves it (SAVED_CLASS) and JSON reads it back"},
        indent=1) + "\n")
    print(f"wrote {HERE}: {len(out)} entries", file=sys.stderr)

if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
