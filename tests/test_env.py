"""env.py: tau2's retail tools, db, tasks and reward; the scripted user; the LLM user."""

import copy
import json
import time
from pathlib import Path

import pytest

import env
import rollout
import synth
import util

REPO = Path(__file__).resolve().parent.parent
TAU2 = REPO.parent / "shared" / "tau2" / "retail"
SHARED = REPO.parent / "shared"
SEED = 0
EOT = "<|im_end|>"

from env import GREETING, LLMUser, clean_reply, respond_all, start_all, system_prompt
from util import PER_KIND, TASK, backend_for, by_kind, play, user_texts, writes


# ----------------------------------------------------------------------------------------------------
# tau2-bench's retail world: tools, db, tasks, reward (against ../shared/notes/tau2_retail_semantics.md)


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


# ----------------------------------------------------------------------------------------------------
# every write tool's effects, written out by hand from ../shared/notes/tau2_retail_semantics.md


def _item(item_id, price, color, size):
    return {"name": "T-Shirt", "product_id": "100", "item_id": item_id, "price": price,
            "options": {"color": color, "size": size}}


BLUE, RED, GREEN = _item("1001", 50.88, "blue", "M"), _item("1002", 53.0, "red", "L"), _item("1003", 47.5, "green", "S")
HOME = {"address1": "1 Elm St", "address2": "", "city": "Austin", "country": "USA", "state": "TX", "zip": "78701"}
NEW = {"address1": "9 Oak Rd", "address2": "Apt 2", "city": "Boston", "country": "USA", "state": "MA", "zip": "02110"}


def _pay(kind, amount, method):
    return {"transaction_type": kind, "amount": amount, "payment_method_id": method}


def _order(oid, status, items, history, fulfillments=(), **optional):
    o = {"order_id": oid, "user_id": "ann_lee_1", "address": dict(HOME), "items": [dict(i) for i in items],
         "status": status, "fulfillments": list(fulfillments), "payment_history": list(history)}
    return {**o, **{k: None for k in env.ORDER_OPTIONAL}, **optional}


def effects_db():
    """One user with a gift card (100.0), a credit card and paypal; #W1 pending (gift card), #W2 pending (credit
    card), #W3 delivered (paypal). One product with three variants."""
    variants = {i["item_id"]: {"item_id": i["item_id"], "options": dict(i["options"]), "available": True,
                               "price": i["price"]} for i in (BLUE, RED, GREEN)}
    user = {"user_id": "ann_lee_1", "name": {"first_name": "Ann", "last_name": "Lee"}, "address": dict(HOME),
            "email": "ann.lee@example.com", "orders": ["#W1", "#W2", "#W3"], "payment_methods": {
                "gift_card_7": {"source": "gift_card", "id": "gift_card_7", "balance": 100.0},
                "credit_card_8": {"source": "credit_card", "id": "credit_card_8", "brand": "visa", "last_four": "4242"},
                "paypal_9": {"source": "paypal", "id": "paypal_9"}}}
    shipped = [{"tracking_id": ["123456789012"], "item_ids": ["1001", "1002"]}]
    return env.canonical_db({
        "products": {"100": {"name": "T-Shirt", "product_id": "100", "variants": variants}},
        "users": {"ann_lee_1": user},
        "orders": {"#W1": _order("#W1", "pending", [BLUE, RED], [_pay("payment", 103.88, "gift_card_7")]),
                   "#W2": _order("#W2", "pending", [BLUE], [_pay("payment", 50.88, "credit_card_8")]),
                   "#W3": _order("#W3", "delivered", [BLUE, RED], [_pay("payment", 103.88, "paypal_9")], shipped)}})


SHIPPED = [{"tracking_id": ["123456789012"], "item_ids": ["1001", "1002"]}]
# tool, arguments -> the records that change (every other record must stay exactly as it was), written by hand
EFFECTS = [
    ("cancel, gift card: refund row, balance credited at once",
     "cancel_pending_order", {"order_id": "#W1", "reason": "ordered by mistake"},
     {"#W1": _order("#W1", "cancelled", [BLUE, RED], [_pay("payment", 103.88, "gift_card_7"),
                                                       _pay("refund", 103.88, "gift_card_7")],
                    cancel_reason="ordered by mistake")}, 203.88),
    ("cancel, credit card: refund row, no balance moves",
     "cancel_pending_order", {"order_id": "#W2", "reason": "no longer needed"},
     {"#W2": _order("#W2", "cancelled", [BLUE], [_pay("payment", 50.88, "credit_card_8"),
                                                 _pay("refund", 50.88, "credit_card_8")],
                    cancel_reason="no longer needed")}, 100.0),
    ("modify items, price up on a credit card: unrounded payment row",
     "modify_pending_order_items", {"order_id": "#W2", "item_ids": ["1001"], "new_item_ids": ["1002"],
                                    "payment_method_id": "credit_card_8"},
     {"#W2": _order("#W2", "pending (item modified)", [RED], [_pay("payment", 50.88, "credit_card_8"),
                                                              _pay("payment", 2.1199999999999974, "credit_card_8")])},
     100.0),
    # two pairs: diff = (53.0 - 50.88) + (47.5 - 53.0) = -3.3800000000000026, a refund; the gift card gets
    # round(100.0 + 3.38..., 2). Pair 2 looks up the first item with id 1002, which is item 0 just renamed by pair 1,
    # so item 0 ends as 1003 and item 1 is untouched; every modified item takes the LAST new variant's price and
    # options (tau2's leftover loop variable)
    ("modify items, price down on a gift card: unrounded refund row, balance credited, tau2's quirks",
     "modify_pending_order_items", {"order_id": "#W1", "item_ids": ["1001", "1002"], "new_item_ids": ["1002", "1003"],
                                    "payment_method_id": "gift_card_7"},
     {"#W1": _order("#W1", "pending (item modified)", [GREEN, RED],
                    [_pay("payment", 103.88, "gift_card_7"), _pay("refund", 3.3800000000000026, "gift_card_7")])},
     103.38),
    ("modify payment to a gift card: payment(new) then refund(old), gift card debited",
     "modify_pending_order_payment", {"order_id": "#W2", "payment_method_id": "gift_card_7"},
     {"#W2": _order("#W2", "pending", [BLUE], [_pay("payment", 50.88, "credit_card_8"),
                                               _pay("payment", 50.88, "gift_card_7"),
                                               _pay("refund", 50.88, "credit_card_8")])}, 49.12),
    ("modify payment away from a gift card: the old gift card is credited back",
     "modify_pending_order_payment", {"order_id": "#W1", "payment_method_id": "paypal_9"},
     {"#W1": _order("#W1", "pending", [BLUE, RED], [_pay("payment", 103.88, "gift_card_7"),
                                                    _pay("payment", 103.88, "paypal_9"),
                                                    _pay("refund", 103.88, "gift_card_7")])}, 203.88),
    ("modify order address: address replaced, status kept",
     "modify_pending_order_address", {"order_id": "#W2", **NEW},
     {"#W2": {**_order("#W2", "pending", [BLUE], [_pay("payment", 50.88, "credit_card_8")]), "address": NEW}}, 100.0),
    ("exchange: fields set, lists sorted each on its own, rounded difference, no money moves",
     "exchange_delivered_order_items", {"order_id": "#W3", "item_ids": ["1002", "1001"],
                                        "new_item_ids": ["1003", "1002"], "payment_method_id": "gift_card_7"},
     {"#W3": _order("#W3", "exchange requested", [BLUE, RED], [_pay("payment", 103.88, "paypal_9")], SHIPPED,
                    exchange_items=["1001", "1002"], exchange_new_items=["1002", "1003"],
                    exchange_payment_method_id="gift_card_7", exchange_price_difference=-3.38)}, 100.0),
    ("return to a gift card: status and fields, no refund row, no balance change",
     "return_delivered_order_items", {"order_id": "#W3", "item_ids": ["1002", "1001"],
                                      "payment_method_id": "gift_card_7"},
     {"#W3": _order("#W3", "return requested", [BLUE, RED], [_pay("payment", 103.88, "paypal_9")], SHIPPED,
                    return_items=["1001", "1002"], return_payment_method_id="gift_card_7")}, 100.0),
    ("return to the original method",
     "return_delivered_order_items", {"order_id": "#W3", "item_ids": ["1001"], "payment_method_id": "paypal_9"},
     {"#W3": _order("#W3", "return requested", [BLUE, RED], [_pay("payment", 103.88, "paypal_9")], SHIPPED,
                    return_items=["1001"], return_payment_method_id="paypal_9")}, 100.0),
]


@pytest.mark.parametrize("label, tool, args, orders, balance", EFFECTS, ids=[e[0].split(":")[0] for e in EFFECTS])
def test_write_tool_effects_by_hand(label, tool, args, orders, balance):
    d = effects_db()
    before = copy.deepcopy(d)
    content, is_error = env.call_tool(d, tool, args)
    assert not is_error, content
    want = copy.deepcopy(before)
    want["orders"].update(copy.deepcopy(orders))
    want["users"]["ann_lee_1"]["payment_methods"]["gift_card_7"]["balance"] = balance
    assert env.canonical_db(d) == want
    assert json.loads(content) == want["orders"][args["order_id"]]  # the tool returns the record it wrote
    assert env.db_hash(d) == env.db_hash(want)


def test_modify_user_address_effect_by_hand():
    d = effects_db()
    content, is_error = env.call_tool(d, "modify_user_address", {"user_id": "ann_lee_1", **NEW})
    assert not is_error
    want = effects_db()
    want["users"]["ann_lee_1"]["address"] = dict(NEW)  # the user's only: orders keep their own addresses
    assert env.canonical_db(d) == want and json.loads(content) == want["users"]["ann_lee_1"]
    assert list(want["users"]["ann_lee_1"]["address"]) == list(json.loads(content)["address"])  # field order too


@pytest.mark.parametrize("tool, args, message", [
    ("modify_pending_order_payment", {"order_id": "#W1", "payment_method_id": "gift_card_7"}, "should be different"),
    ("modify_pending_order_items", {"order_id": "#W2", "item_ids": ["1001"], "new_item_ids": ["1001"],
                                    "payment_method_id": "credit_card_8"}, "should be different"),
    ("return_delivered_order_items", {"order_id": "#W3", "item_ids": ["1001"], "payment_method_id": "credit_card_8"},
     "original payment method"),
    ("exchange_delivered_order_items", {"order_id": "#W1", "item_ids": ["1001"], "new_item_ids": ["1002"],
                                        "payment_method_id": "gift_card_7"}, "Non-delivered"),
    ("cancel_pending_order", {"order_id": "#W3", "reason": "no longer needed"}, "Non-pending"),
])
def test_refused_writes_change_nothing(tool, args, message):
    d = effects_db()
    content, is_error = env.call_tool(d, tool, args)
    assert is_error and message in content
    assert env.canonical_db(d) == effects_db()


CALC_BOMBS = [
    "*".join(["9**99999"] * 30)[:299],        # the reported 299-character chain: 9.3 s before the bound
    "*".join(["9**400"] * 60)[:999],          # each power small, their product quadratic in size
    "(" * 150 + "1" + ")" * 150, "-" * 500 + "1", "+-" * 300 + "1",  # nesting
    "9" * 1500, "1" * 1000 + "*" + "1" * 999,   # long literals, and the length limit
    "2**4096", "2**4095*2", "10**1000/10**999", "(10**300)**-5", "(-8)**0.5", "2.0**99999", "7//0.0",
]


@pytest.mark.parametrize("expr", CALC_BOMBS, ids=range(len(CALC_BOMBS)))
def test_calculate_is_bounded_in_size_and_time(expr):
    import time
    env.call_tool({}, "calculate", {"expression": "1+1"})  # warm-up
    t0 = time.perf_counter()
    content, is_error = env.call_tool({}, "calculate", {"expression": expr})
    assert time.perf_counter() - t0 < 0.1, expr[:40]
    assert isinstance(content, str) and len(content) < 200
    if is_error:
        assert content.startswith("Error: ")


def test_calculate_bounds_keep_normal_results():
    # big but finite answers still come out as tau2 prints them; only ints past MAX_INT_BITS are refused
    assert env.calculate({}, "2**1000 / 2**999") == "2.0"
    assert env.calculate({}, "10**300 * 10**2") == "1e+302"
    assert env.calculate({}, "(" * 90 + "1" + ")" * 90) == "1.0"
    with pytest.raises(env.ToolError, match="too large"):
        env.calculate({}, "2**5000")
    with pytest.raises(env.ToolError, match="longer than"):
        env.calculate({}, "1+" * 600 + "1")


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


def _broken(db, how):
    """A copy of db with one record broken; -> (db, the record, the field) an error must name."""
    d = copy.deepcopy(db)
    uid, u = next((k, u) for k, u in d["users"].items() if u["orders"])
    oid = u["orders"][0]
    o = d["orders"][oid]
    pid, p = next(iter(d["products"].items()))
    vid = next(iter(p["variants"]))
    if how == "price a string":
        p["variants"][vid]["price"] = "12.50"
        return d, f"products['{pid}'].variants['{vid}']", "price"
    if how == "available a string":
        p["variants"][vid]["available"] = "yes"
        return d, f"variants['{vid}']", "available"
    if how == "amount a string":
        o["payment_history"][0]["amount"] = "10"
        return d, f"orders['{oid}'].payment_history[0]", "amount"
    if how == "balance null":
        m = next(m for u in d["users"].values() for m in u["payment_methods"].values() if "balance" in m)
        m["balance"] = None
        return d, f"payment_methods['{m['id']}']", "balance"
    if how == "orders not a list":
        u["orders"] = oid
        return d, f"users['{uid}']", "orders"
    if how == "unknown status":
        o["status"] = "shipped"
        return d, f"orders['{oid}']", "status"
    if how == "order of a missing user":
        o["user_id"] = "nobody_1234"
        return d, f"orders['{oid}']", "user_id"
    if how == "order not listed by its user":
        u["orders"].remove(oid)
        return d, f"orders['{oid}']", "user_id"
    if how == "user lists a missing order":
        del d["orders"][oid]
        return d, f"users['{uid}']", "orders[0]"
    if how == "item of a missing product":
        o["items"][0]["product_id"] = "0000000000"
        return d, f"orders['{oid}'].items[0]", "product_id"
    if how == "item not a variant of its product":
        o["items"][0]["item_id"] = "0000000000"
        return d, f"orders['{oid}'].items[0]", "item_id"
    if how == "payment with another user's method":
        other = next(m for k, v in d["users"].items() if k != uid for m in v["payment_methods"])
        o["payment_history"][0]["payment_method_id"] = other
        return d, f"orders['{oid}'].payment_history[0]", "payment_method_id"
    if how == "key differs from id":
        p["variants"][vid]["item_id"] = "1"
        return d, f"variants['{vid}']", "item_id"
    raise ValueError(how)


BROKEN = ["price a string", "available a string", "amount a string", "balance null", "orders not a list",
          "unknown status", "order of a missing user", "order not listed by its user", "user lists a missing order",
          "item of a missing product", "item not a variant of its product", "payment with another user's method",
          "key differs from id"]


@pytest.mark.parametrize("how", BROKEN)
def test_load_db_checks_types_and_references(how, tmp_path):
    good = synth.generate_shop(SEED, n_users=10)
    p = tmp_path / "shop.json"
    p.write_text(json.dumps(good))
    env.load_db(p)  # the generated shop itself is fine
    bad, record, field = _broken(good, how)
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError) as e:
        env.load_db(p)
    msg = str(e.value)
    assert str(p) in msg and record in msg and field in msg, msg


def test_tau2_db_keeps_every_checked_reference():
    need_tau2()
    env.load_db(TAU2 / "db.json")  # loads: it breaks none of the checks


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


def test_string_arguments_that_escape_json_become_errors():
    # call_tool decodes string arguments itself (the MCP and OpenAI paths hand them over as text)
    for args in ("[" * 100000 + "]" * 100000, '{"order_id": ' + "9" * 5000 + "}"):
        content, is_error = env.call_tool({}, "get_order_details", args)
        assert is_error and content.startswith("Error: Invalid JSON"), content[:200]
    # nor from validation (the error quotes the value) or a tool's own message
    deep = [0]
    for _ in range(5000):
        deep = [deep]
    for args in ({"order_id": deep}, {"order_id": int("9" * 4000) * 10 ** 400}):
        content, is_error = env.call_tool({}, "get_order_details", args)
        assert is_error and content.startswith("Error: Argument 'order_id'"), content[:200]
    content, is_error = env.call_tool({"orders": {}}, "get_order_details", {"order_id": "x" * 10**6})
    assert (content, is_error) == ("Error: Order not found", True)
    content, is_error = env.call_tool({}, "x" * 10**6, {})
    assert is_error and len(content) <= env.MAX_ERROR_CHARS


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


# ----------------------------------------------------------------------------------------------------
# the scripted user on the generated shop, played against synth.OracleAgent (text-only episodes)


class Tamper:
    """The oracle, except that its write's arguments are changed by `edit(task, name, args)`, and/or an extra
    write is made right after it."""

    def __init__(self, task, seed, db, edit=None, extra=None):
        self.o, self.task, self.db, self.edit, self.extra = synth.OracleAgent(task, seed), task, db, edit, extra
        self.after_write = False

    def act(self, messages):
        if self.after_write and self.extra:
            self.after_write = False
            name, args = self.extra
            return synth.tool_call_text(name, **args)
        text = self.o.act(messages)
        msg = env.parse_assistant(text)
        calls = msg.get("tool_calls", [])
        if calls and calls[0]["function"]["name"] in env.WRITE_TOOLS:
            self.after_write = True
            name, args = calls[0]["function"]["name"], dict(calls[0]["function"]["arguments"])
            if self.edit:
                args = self.edit(self.db, name, args)
            return synth.tool_call_text(name, **args)
        return text


def wrong_args(db, name, args):
    if "reason" in args:
        args["reason"] = next(r for r in synth.REASONS if r != args["reason"])
    elif "order_id" in args:
        o = db["orders"][args["order_id"]]
        args["order_id"] = next(k for k, v in db["orders"].items()
                                if v["status"] == o["status"] and k != o["order_id"])
    else:
        args["address1"] = "1 Wrong Way"
    return args


def one_per_write_kind(splits):
    kinds = by_kind(splits["train"])
    return [kinds[k][0] for k in synth.TASK_KINDS if k != "info"]


def test_wrong_write_arguments_give_zero(shop, splits):
    tasks = one_per_write_kind(splits)
    eps = play(tasks, shop, make_agent=lambda t, s: Tamper(t, s, shop, edit=wrong_args))
    for t, ep in zip(tasks, eps):
        assert ep.reward == 0.0 and ep.reward_info["failed"] == "db", (t["kind"], ep.reward_info)
        assert len(writes(ep)) == 1
        if t["kind"] in ("cancel", "user_address"):  # the wrong write itself succeeded
            res = [m for m in ep.messages if m["role"] == "tool"][-1]
            assert not res["content"].startswith("Error"), res


def test_extra_write_gives_zero(shop, splits):
    tasks = one_per_write_kind(splits)
    # control: the tamperer with nothing to tamper is the oracle
    assert all(ep.reward == 1.0 for ep in play(tasks, shop, make_agent=lambda t, s: Tamper(t, s, shop)))

    def make(t, s):
        addr = dict(address1="77 Extra St", address2="", city="Austin", state="TX", country="USA", zip="78701")
        return Tamper(t, s, shop, extra=("modify_user_address", dict(user_id=t["script"]["user_id"], **addr)))
    eps = play(tasks, shop, make_agent=make)
    for t, ep in zip(tasks, eps):
        assert len(writes(ep)) == 2 and ep.tool_errors == 0, t["kind"]
        assert ep.reward == 0.0 and ep.reward_info["failed"] == "db", (t["kind"], ep.reward_info)


def test_user_without_email_never_says_it(shop, sample, oracle_eps):
    """Tasks whose user does not know their email: the email never appears, even when the agent insists."""
    no_email = [t for t in sample if t["script"]["email"] is None]
    assert no_email
    for t, ep in zip(sample, oracle_eps):
        if t["script"]["email"] is None:
            email = shop["users"][t["script"]["user_id"]]["email"]
            assert not any(email.lower() in u.lower() for u in user_texts(ep))

    class Pushy:
        def act(self, messages):
            return "What is your e-mail address? I need your email to verify your identity."
    eps = play(no_email, shop, make_agent=lambda t, s: Pushy(), max_turns=8)
    for t, ep in zip(no_email, eps):
        u = shop["users"][t["script"]["user_id"]]
        texts = user_texts(ep)
        assert not any(u["email"].lower() in x.lower() for x in texts)
        assert any(u["address"]["zip"] in x for x in texts[1:])  # it offers name and zip instead
        assert ep.end_reason == "user_stop"
        assert (ep.reward == 1.0) == (t["kind"] == "info")  # nothing was done, which only an info task wants


def test_identity_only_when_asked(shop, sample, oracle_eps):
    for t, ep in zip(sample, oracle_eps):
        u = shop["users"][t["script"]["user_id"]]
        said = " ".join(" ".join(p["say"]) for p in t["script"]["phases"])
        secrets = [u["email"]] + ([u["address"]["zip"]] if u["address"]["zip"] not in said else [])
        first = ep.messages[1]["content"]
        assert not any(s in first for s in secrets), first
        assert any(s in first for s in t["script"]["phases"][0]["say"])
        # the first message that identifies the user answers an assistant turn that asked for it
        msgs = ep.messages
        i = next(i for i, m in enumerate(msgs) if m["role"] == "user" and any(s in m["content"] for s in secrets))
        assert msgs[i - 1]["role"] == "assistant" and env.ASKS_ID.search(msgs[i - 1]["content"])

    # an agent that never asks is never told
    class Mute:
        def act(self, messages):
            return "Okay."
    tasks = [t for t in sample if shop["users"][t["script"]["user_id"]]["address"]["zip"]
             not in " ".join(" ".join(p["say"]) for p in t["script"]["phases"])][:10]
    eps = play(tasks, shop, make_agent=lambda t, s: Mute(), max_turns=10)
    for t, ep in zip(tasks, eps):
        u = shop["users"][t["script"]["user_id"]]
        texts = user_texts(ep)
        assert len(texts) >= 3 and ep.end_reason == "user_stop"  # patience ran out
        assert not any(u["email"] in x or u["address"]["zip"] in x for x in texts), texts


def test_wording_seeded(shop, sample, oracle_eps):
    again = play(sample, shop)
    assert [e.messages for e in again] == [e.messages for e in oracle_eps]
    other = play(sample, shop, seed=SEED + 1)
    differ = sum(user_texts(a) != user_texts(b) for a, b in zip(oracle_eps, other))
    assert differ >= len(sample) // 4
    assert all(e.reward == 1.0 for e in other)


def test_confirmation_of_wrong_order_gets_no(shop, splits):
    n = 0
    for t in splits["train"][:60]:
        p = t["script"]["phases"][0]
        if t["kind"] == "switch" or not p.get("write") or "order_id" not in p["write"]["arguments"]:
            continue
        oid = p["write"]["arguments"]["order_id"]
        other = next(o for o in shop["orders"] if o != oid)
        right = f"I will do this: {' '.join(p['confirm_keys'])}. Shall I go ahead (yes/no)?"
        wrong = right.replace(oid, other)
        assert oid not in wrong
        u = env.ScriptedUser(t, 1)
        u.start()
        no = u.respond(wrong)
        assert no.startswith("No") and not u.done, no
        assert u.respond(right).startswith("Yes")
        assert u.respond("Done.").endswith(env.STOP) and u.done and u.end_reason == "user_stop"
        n += 1
    assert n >= 10


def test_cooperative_user_states_everything_and_keeps_its_mind(shop, splits):
    """The cooperative user (grpo/synth --user cooperative) names its request and identity in its first message
    and plays a switch task as its final request only; the dynamic user (the default) does neither."""
    tasks = splits["train"][:40]
    switch = [t for t in tasks if t["kind"] == "switch"]
    assert switch
    coop = [env.cooperative_task(t) for t in tasks]
    assert env.cooperative_task(coop[0]) == coop[0]  # idempotent
    for t, c in zip(tasks, coop):
        assert c["evaluation_criteria"] == t["evaluation_criteria"] and len(c["script"]["phases"]) == 1
        first = env.ScriptedUser(c, 3).start()
        ident = t["script"]["email"] or t["script"]["zip"]
        assert ident in first, first
        assert ident not in env.ScriptedUser(t, 3).start()  # the dynamic user waits to be asked
    # the oracle solves every cooperative task; on switch tasks with no change of mind, in fewer turns
    eps, dyn = play(coop, shop), play(tasks, shop)
    assert all(e.reward == 1.0 for e in eps)
    assert not any("changed my mind" in " ".join(user_texts(e)) or "second thought" in " ".join(user_texts(e))
                   for e in eps)
    assert any("changed my mind" in " ".join(user_texts(e)) or "second thought" in " ".join(user_texts(e))
               for e in dyn)  # the control: the dynamic user does change its mind
    assert sum(e.turns for e in eps) < sum(e.turns for e in dyn)


def test_info_communicate(shop, splits):
    tasks = by_kind(splits["train"])["info"][:PER_KIND] + by_kind(splits["test"])["info"][:PER_KIND]
    assert all(t["evaluation_criteria"]["communicate_info"] for t in tasks)
    eps = play(tasks, shop, basis="task")
    for ep in eps:
        assert ep.reward == 1.0 and ep.reward_info["communicate_ok"] is True and ep.end_reason == "user_stop"

    class Vague:
        def act(self, messages):
            return "Let me look into that for you."
    eps = play(tasks, shop, make_agent=lambda t, s: Vague(), basis="task")
    for ep in eps:
        assert ep.reward == 0.0 and ep.reward_info["failed"] == "communicate", ep.reward_info
        assert ep.reward_info["db_match"] is True and ep.reward_info["basis"] == "task"
    # without the check the same transcripts score 1 (the shop is untouched, as the gold says)
    eps = play(tasks, shop, make_agent=lambda t, s: Vague())
    assert all(ep.reward == 1.0 and ep.reward_info["basis"] == "db" for ep in eps)


# ----------------------------------------------------------------------------------------------------
# the LLM user (roles flipped), on stub backends and a fake OpenAI-compatible endpoint


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
        """A backend keeps chat()'s contract: the poisoned conversation's reply is its exception, the others are
        answered. With `crash`, the whole call raises instead (a local model that breaks)."""
        def __init__(self, crash=False):
            self.calls, self.crash = [], crash

        def chat(self, batch, max_new_tokens, temperature, seed):
            self.calls.append(len(batch))
            if self.crash and any(m[-1]["content"] == "poison" for m in batch):
                raise ValueError("crash")
            return [ValueError("boom") if m[-1]["content"] == "poison" else "fine" for m in batch]

    a, b = CountingBackend("A"), Flaky()
    users = [LLMUser(TASK, a), LLMUser(TASK, b, max_retries=0), LLMUser(TASK, b, max_retries=0)]
    start_all(users)
    assert a.calls == [1] and b.calls == [2]
    out = respond_all(users, ["x", "poison", "y"])
    assert out == ["A 4", "", "fine"] and b.calls == [2, 2]  # one call; one bad conversation costs no other
    assert users[1].end_reason == "user_error" and "boom" in users[1].error
    assert users[2].error is None and not users[2].done
    c = Flaky(crash=True)
    users = [LLMUser(TASK, c, max_retries=1), LLMUser(TASK, c, max_retries=1)]
    start_all(users)
    assert respond_all(users, ["poison", "y"]) == ["", ""] and c.calls == [2, 2, 2]  # a crash fails the call
    assert all("crash" in u.error and "2 attempt(s)" in u.error for u in users)


def test_user_deadline_errors_the_episode_with_its_reason():
    """A user whose backend keeps it waiting past its episode deadline fails (no further request is sent), and
    the episode is errored with the reason in its transcript, never scored 0."""
    class Slow:
        def __init__(self):
            self.calls = 0

        def chat(self, batch, max_new_tokens, temperature, seed):
            self.calls += 1
            time.sleep(0.05)
            return ["Hi, I need help with an order."] * len(batch)
    backend = Slow()
    task = dict(TASK, evaluation_criteria={"actions": [], "communicate_info": []})
    world = util.shop(user=lambda t, s: LLMUser(t, backend, deadline=0.12), max_turns=10)
    eps = rollout.run_episodes(rollout.TextAgents(lambda t, s: PlainAgent()), world, [task])
    ep = eps[0]
    assert ep.errored and ep.end_reason == "user_error" and "out of time" in ep.error and ep.reward == 0.0
    assert ep.reward_info == {} and "out of time" in ep.to_json()["error"]
    # 0.05 s or more each: the second or third pushed it past 0.12 s (a loaded machine sleeps longer), and no
    # request was sent after that
    assert backend.calls in (2, 3)


class PlainAgent:
    def act(self, messages):
        return "Could you tell me more?"


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
    assert system_prompt(TASK).startswith(env.FALLBACK_GUIDELINES)  # no guidelines given: our own wording
    tau2_file = SHARED / "tau2" / "user_simulator" / "simulation_guidelines.md"
    if tau2_file.is_file():
        text = env.load_guidelines(tau2_file)
        assert "###STOP###" in text and "User Simulation Guidelines" in text
        assert env.guidelines_beside(SHARED / "tau2" / "retail" / "tasks.json") == str(tau2_file.resolve())
    assert env.guidelines_beside(None) is None
    with pytest.raises(FileNotFoundError, match="nowhere.md"):
        env.load_guidelines("nowhere.md")
