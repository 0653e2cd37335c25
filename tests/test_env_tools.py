"""env.py against tau2-bench's retail semantics (see ../shared/notes/tau2_retail_semantics.md)."""

import copy
import json
from pathlib import Path

import pytest

import env

TAU2 = Path(__file__).resolve().parent.parent.parent / "shared" / "tau2" / "retail"

def need_tau2():
    if not (TAU2 / "db.json").exists() or not (TAU2 / "tasks.json").exists():
        pytest.skip(f"{TAU2} absent")

@pytest.fixture(scope="module")
def db():
    need_tau2()
    return env.load_db(TAU2 / "db.json")

@pytest.fixture(scope="module")
def tasks():
    need_tau2()
    return {t["id"]: t for t in env.load_tasks(TAU2 / "tasks.json")}

@pytest.fixture(scope="module")
def replays(db, tasks):
    """task id -> (end db, [(action, content, is_error)], end hash), each replayed on a fresh copy."""
    out = {}
    for tid, t in tasks.items():
        d = env.canonical_db(db)  # a fresh deep copy, as gold_db makes
        acts = t["evaluation_criteria"]["actions"]
        res = [(a, c, e) for a, (c, e) in zip(acts, env.replay_actions(d, acts))]
        out[tid] = (d, res, env.db_hash(d))
    return out

# ---------------------------------------------------------------- gold replay of all 114 tasks

EXPECTED_FAILURES = sorted([
    ("2", "get_product_details", "Error: Product not found"),
    ("3", "get_product_details", "Error: Product not found"),
    ("4", "get_product_details", "Error: Product not found"),
    ("35", "find_user_id_by_email", "Error: User not found"),
    ("37", "find_user_id_by_email", "Error: User not found"),
    ("38", "find_user_id_by_email", "Error: User not found"),
    ("39", "find_user_id_by_name_zip", "Error: User not found"),
    ("46", "get_order_details", "Error: Order not found"),
    ("46", "get_order_details", "Error: Order not found"),
    ("47", "get_order_details", "Error: Order not found"),
    ("47", "get_order_details", "Error: Order not found"),
    ("54", "find_user_id_by_email", "Error: User not found"),
    ("55", "find_user_id_by_email", "Error: User not found"),
    ("64", "exchange_delivered_order_items", "Error: Non-delivered order cannot be exchanged"),
    ("67", "find_user_id_by_name_zip", "Error: User not found"),
    ("67", "find_user_id_by_name_zip", "Error: User not found"),
    ("68", "find_user_id_by_name_zip", "Error: User not found"),
    ("105", "exchange_delivered_order_items", "Error: Insufficient gift card balance to pay for the price difference"),
])

def test_counts(tasks):
    acts = [a for t in tasks.values() for a in t["evaluation_criteria"]["actions"]]
    assert len(tasks) == 114 and len(acts) == 550
    assert sum(a["name"] in env.WRITE_TOOLS for a in acts) == 176

def test_exactly_the_known_actions_fail(replays):
    failures = sorted((tid, a["name"], c) for tid, (_, res, _) in replays.items() for a, c, e in res if e)
    assert failures == EXPECTED_FAILURES
    # and every failure is a tau2 error, never one of our argument-check errors
    assert all(not c.startswith("Error: Error") for _, _, c in failures)

def test_unchanged_tasks(db, replays):
    h0 = env.db_hash(db)
    same = sorted((tid for tid, (_, _, h) in replays.items() if h == h0), key=int)
    assert same == ["10", "12", "24", "25", "50", "57", "62", "65", "67", "68", "105"]

def test_shared_end_state(replays):
    assert replays["36"][2] == replays["37"][2]
    assert replays["36"][0] == replays["37"][0]

def test_task55_gift_card_refund(db, replays):
    before = db["users"]["amelia_silva_7726"]["payment_methods"]["gift_card_3491931"]["balance"]
    after = replays["55"][0]["users"]["amelia_silva_7726"]["payment_methods"]["gift_card_3491931"]["balance"]
    assert (before, after) == (73.0, 2533.21)

def test_task21_modify_items_quirk(db, replays):
    order = replays["21"][0]["orders"]["#W9911714"]
    last = order["payment_history"][-1]
    assert last == {"transaction_type": "payment", "amount": 41.91999999999999, "payment_method_id": "gift_card_4332117"}
    assert order["status"] == "pending (item modified)"
    # both modified items carry the LAST new variant's price and options (tau2's leftover loop variable)
    keyboard = db["products"]["1656367028"]["variants"]["1421289881"]
    by_id = {it["item_id"]: it for it in order["items"]}
    for new_id in ("4107812777", "1421289881"):
        assert by_id[new_id]["price"] == keyboard["price"] == 268.77
        assert by_id[new_id]["options"] == keyboard["options"]
    assert by_id["4107812777"]["name"] == "Running Shoes"  # name and product_id stay

def test_task40_payment_swap(replays):
    hist = replays["40"][0]["orders"]["#W4923227"]["payment_history"]
    assert hist == [
        {"transaction_type": "payment", "amount": 321.18, "payment_method_id": "credit_card_8554680"},
        {"transaction_type": "payment", "amount": 321.18, "payment_method_id": "credit_card_8897086"},
        {"transaction_type": "refund", "amount": 321.18, "payment_method_id": "credit_card_8554680"}]

def test_exchange_lists_sorted_separately(replays):
    o = replays["58"][0]["orders"]["#W5838674"]  # gold call: item_ids ['7441167885', '3478699712']
    assert o["status"] == "exchange requested"
    assert o["exchange_items"] == ["3478699712", "7441167885"]
    assert o["exchange_new_items"] == ["3815173328", "6017636844"]
    assert o["exchange_payment_method_id"] == "gift_card_9368765"
    assert replays["0"][0]["orders"]["#W2378156"]["exchange_price_difference"] == -16.63

@pytest.mark.parametrize("expr, want", [
    ("155.33 - 147.05 + 268.77 - 235.13", "41.92"), ("135.24 - 153.23", "-17.99"), ("2 + 2", "4.0"),
    ("1 - 1.005", "-0.0"), ("2.675*1", "2.67"), ("10**18", "1e+18"), ("7 // 2", "3.0"), ("2 ** 3 ** 2", "512.0"),
    ("-2**2", "-4.0"), ("2**-1", "0.5"), ("-(1 + 2) * 3", "-9.0"), (".5 + 1.", "1.5"), ("00", "0.0")])
def test_calculate(expr, want):
    assert env.call_tool({}, "calculate", {"expression": expr}) == (want, False)

@pytest.mark.parametrize("expr, msg", [
    ("1/0", "Error: division by zero"), ("1e5", "Error: Invalid characters in expression"),
    ("__import__('os')", "Error: Invalid characters in expression"), ("abs(1)", "Error: Invalid characters in expression"),
    ("5 % 2", "Error: Invalid characters in expression"), ("", "Error: Invalid expression"), ("01", "Error: Invalid expression"),
    ("(1 + 2", "Error: Invalid expression"), ("1 2", "Error: Invalid expression"), ("2* *3", "Error: Invalid expression"),
    ("9**9**9**9", "Error: Invalid expression")])
def test_calculate_errors(expr, msg):
    content, is_error = env.call_tool({}, "calculate", {"expression": expr})
    assert is_error and content.startswith(msg)

# ---------------------------------------------------------------- database files

def test_dump_roundtrip_and_canonical_nulls(db, replays, tmp_path):
    d = replays["21"][0]
    env.dump_db(d, tmp_path / "end.json")
    again = env.load_db(tmp_path / "end.json")
    assert env.db_hash(again) == env.db_hash(d)
    raw = json.loads((TAU2 / "db.json").read_text())
    assert "cancel_reason" not in next(iter(raw["orders"].values()))  # the file omits them...
    assert env.db_hash(raw) == env.db_hash(db)  # ...but the hash is of the canonical form either way
    for o in env.canonical_db(raw)["orders"].values():
        assert all(k in o for k in env.ORDER_OPTIONAL)
    o = env.canonical_db(raw)["orders"]["#W2611340"]
    assert [o[k] for k in env.ORDER_OPTIONAL] == [None] * 7

def test_load_db_errors(tmp_path):
    p = tmp_path / "db.json"
    p.write_text('{"products": {},\n "users": {]}')
    with pytest.raises(ValueError, match=r"db\.json:2:\d+"):
        env.load_db(p)
    p.write_text('{"products": {}, "users": {}}')
    with pytest.raises(ValueError, match="db.json.*orders"):
        env.load_db(p)
    p.write_text(json.dumps({"products": {}, "users": {}, "orders": {"#W1": {"order_id": "#W1"}}}))
    with pytest.raises(ValueError, match=r"db\.json.*#W1.*'user_id'"):
        env.load_db(p)

# ---------------------------------------------------------------- call_tool never raises

@pytest.mark.parametrize("name, args, needle", [
    ("get_order_details", '{"order_id": ', "Invalid JSON"),
    ("get_order_details", "[1, 2]", "JSON object"),
    ("delete_everything", {}, "Unknown tool 'delete_everything'"),
    (None, {}, "Unknown tool"),
    ("get_order_details", {}, "Missing required argument 'order_id'"),
    ("get_order_details", {"order_id": 123}, "'order_id'"),
    ("return_delivered_order_items", {"order_id": "#W4817420", "item_ids": "6777246137",
                                      "payment_method_id": "gift_card_8168843"}, "'item_ids'"),
    ("return_delivered_order_items", {"order_id": "#W4817420", "item_ids": [6777246137],
                                      "payment_method_id": "gift_card_8168843"}, "array of strings"),
    ("get_order_details", {"order_id": "#W4817420", "verbose": True}, "Unexpected argument 'verbose'"),
    ("get_order_details", {"order_id": "W4817420"}, "Order not found"),
])
def test_call_tool_errors(db, name, args, needle):
    d = env.canonical_db(db)
    h = env.db_hash(d)
    content, is_error = env.call_tool(d, name, args)
    assert is_error and content.startswith("Error: ") and needle in content
    assert env.db_hash(d) == h

def test_call_tool_unexpected_exception_becomes_error():
    broken = {"products": {}, "users": {}, "orders": {"#W1": {"status": "delivered", "user_id": "u"}}}
    content, is_error = env.call_tool(broken, "return_delivered_order_items",
                                      {"order_id": "#W1", "item_ids": [], "payment_method_id": "x"})
    assert is_error and content.startswith("Error: ")

def test_call_tool_json_string_args_and_serialisation(db):
    content, is_error = env.call_tool(db, "find_user_id_by_email", '{"email": "Noah.Brown7922@example.com"}')
    assert (content, is_error) == ("noah_brown_6181", False)  # plain strings pass through unquoted
    content, _ = env.call_tool(db, "get_order_details", {"order_id": "#W2611340"})
    assert content.startswith('{"order_id": "#W2611340", "user_id": "james_li_5688", "address": {"address1"')
    assert content.endswith('"return_items": null, "return_payment_method_id": null}')
    types = json.loads(env.call_tool(db, "list_all_product_types", {})[0])
    assert len(types) == 50 and list(types) == sorted(types)

def test_schemas():
    assert len(env.TOOL_SCHEMAS) == 16 and len(set(env.TOOL_NAMES)) == 16
    assert env.WRITE_TOOLS < set(env.TOOL_NAMES) and len(env.WRITE_TOOLS) == 7
    s = {t["function"]["name"]: t["function"]["parameters"] for t in env.TOOL_SCHEMAS}
    assert s["exchange_delivered_order_items"]["properties"]["item_ids"] == {
        "type": "array", "description": s["exchange_delivered_order_items"]["properties"]["item_ids"]["description"],
        "items": {"type": "string"}}
    assert s["modify_user_address"]["required"] == ["user_id", "address1", "address2", "city", "state", "country", "zip"]
    assert s["list_all_product_types"]["required"] == []

# ---------------------------------------------------------------- tasks files

def test_load_tasks_jsonl(tmp_path):
    good = {"id": "t1", "user_scenario": {"instructions": {"reason_for_call": "x"}},
            "evaluation_criteria": {"actions": []}}
    p = tmp_path / "tasks.jsonl"
    env.save_tasks([good, dict(good, id="t2")], p)
    p.write_text(p.read_text() + "\n")  # blank lines are fine
    assert [t["id"] for t in env.load_tasks(p)] == ["t1", "t2"]
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{not json\n")
    with pytest.raises(ValueError, match=":3:"):
        env.load_tasks(p)
    p.write_text(json.dumps(good) + "\n\n" + json.dumps({"id": "t3", "user_scenario": {"instructions": {}}}) + "\n")
    with pytest.raises(ValueError, match=r":3:.*evaluation_criteria\.actions"):
        env.load_tasks(p)
    p.write_text("[\n" + json.dumps(good) + ",\n" + json.dumps({"id": "t4"}) + "\n]")
    with pytest.raises(ValueError, match=r":3:.*user_scenario\.instructions"):
        env.load_tasks(p)

# ---------------------------------------------------------------- reward

def test_reward(db, tasks, replays):
    t = tasks["21"]
    final = replays["21"][0]
    r = env.compute_reward(t, db, final)
    assert (r.reward, r.db_match, r.communicate_ok, r.failed) == (1.0, True, None, "")
    wrong = env.canonical_db(final)
    # one extra write that succeeds but is not in the gold actions
    _, is_error = env.call_tool(wrong, "modify_user_address", {"user_id": "noah_brown_6181", "address1": "1 A St",
                                "address2": "", "city": "X", "state": "CO", "country": "USA", "zip": "80279"})
    assert is_error is False
    r = env.compute_reward(t, db, wrong)
    assert (r.reward, r.db_match, r.failed) == (0.0, False, "db")
    r = env.compute_reward(tasks["0"], db, db)  # nothing done for a task that needs an exchange
    assert (r.reward, r.failed) == (0.0, "db")

def test_reward_communicate(db, tasks, replays):
    tid = next(tid for tid, t in tasks.items() if t["evaluation_criteria"].get("communicate_info"))
    t, final = tasks[tid], replays[tid][0]
    infos = t["evaluation_criteria"]["communicate_info"]
    said = [{"role": "user", "content": " ".join(infos)},  # the user saying it does not count
            {"role": "assistant", "content": "Done.", "tool_calls": []}]
    r = env.compute_reward(t, db, final, said, check_communicate=True)
    assert (r.reward, r.communicate_ok, r.failed) == (0.0, False, "communicate")
    said.append({"role": "assistant", "content": "The numbers: " + "; ".join(i.upper() for i in infos)})
    r = env.compute_reward(t, db, final, said, check_communicate=True)
    assert (r.reward, r.communicate_ok, r.failed) == (1.0, True, "")
    r = env.compute_reward(t, db, final, said[:2], check_communicate=False)
    assert (r.reward, r.communicate_ok) == (1.0, None)
    # commas are stripped from the message, so "1,234.5" in text matches "1234.5" in communicate_info
    t2 = copy.deepcopy(t)
    t2["evaluation_criteria"]["communicate_info"] = ["1234.5"]
    r = env.compute_reward(t2, db, final, [{"role": "assistant", "content": "That is $1,234.5 total."}], True)
    assert r.communicate_ok is True
