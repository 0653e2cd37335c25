"""Build the TAU1 fixtures from tau-bench v1's own code (run once, by hand; tests never run it).

    python tests/tau1_record.py --v1 /tmp/taubench --export /tmp/tau1_export

--v1 is a checkout of sierra-research/tau-bench (commit 59a200c), imported from there for this run only; nothing of it
is copied into the project. It writes:
  - with --export: v1's data in the layout env.Tau1 reads (<export>/<domain>/{tables}.json, wiki.md,
    tasks_<split>.json as v1's Task fields), for running the tests without ../shared/tau1;
  - tests/tau1/gold_hashes.json: per domain and split, per task index, v1's data hash after the task's gold actions
    (v1's Env.step on each action but transfer_to_human_agents, then Env.get_data_hash, as v1's calculate_reward);
  - tests/tau1/calls_<domain>.json.gz: random episodes of calls, valid and invalid (our generator below), each call
    run by v1's Env.step on v1's data: [name, kwargs, observation (or "sha256:<16 hex>" when long), v1's error status,
    sha256(json.dumps(data, sort_keys=True))[:16] after the call], and v1's get_data_hash at each episode's end;
  - tests/tau1/provenance.json: repository, commit, command, counts.
"""
import argparse
import gzip
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "tau1"
SPLITS = {"retail": ("test", "train", "dev"), "airline": ("test",)}
TABLES = {"retail": ("orders", "products", "users"), "airline": ("flights", "reservations", "users")}


def v1_env(domain, split="test"):
    from tau_bench.envs import get_env
    return get_env(domain, user_strategy="human", user_model="none", task_split=split, task_index=0)


def v1_tasks(domain, split):
    return v1_env(domain, split).tasks


def digest(data):
    """The data after a call, cheaply: equal iff the JSON (ints and floats apart, as v1's hash) is equal."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def shown(text):
    return text if len(text) <= 200 else "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def v1_error(text):
    return text.startswith(("Error", "Unknown action"))


# ----------------------------------------------------------------------------------------------------
# random calls: plausible arguments drawn from the current data, then (about a third) broken in one way

def junk(rng):
    return rng.choice(["", "foo", "#W0000000", "1234567890", "sara_doe_496", "HAT001", "ZZZZZZ", "gift_card_0"])


def address(rng):
    return {"address1": f"{rng.randint(1, 999)} Main St", "address2": rng.choice(["", "Apt 2"]),
            "city": rng.choice(["Austin", "Boston"]), "state": rng.choice(["TX", "MA"]), "country": "USA",
            "zip": f"{rng.randint(10000, 99999)}"}


def retail_call(rng, data):
    users, orders, products = data["users"], data["orders"], data["products"]
    uid = rng.choice(list(users))
    u = users[uid]
    status = rng.choice(["pending", "delivered", "any"])
    pool = [o for o in u["orders"] if status == "any" or orders[o]["status"] == status] or u["orders"] or list(orders)
    oid = rng.choice(pool)
    o = orders[oid]
    pay = rng.choice(list(u["payment_methods"]) + ["credit_card_0000000"] * (rng.random() < 0.1))
    items = [it["item_id"] for it in o["items"]]
    picked = rng.sample(items, rng.randint(1, len(items))) if items and rng.random() < 0.9 else []
    if picked and rng.random() < 0.1:
        picked.append(picked[0])  # a duplicate
    by_item = {it["item_id"]: it["product_id"] for it in o["items"]}
    new = [rng.choice(list(products[by_item[i]]["variants"])) if rng.random() < 0.9 else i for i in picked]
    if rng.random() < 0.05:
        new = new[:-1]
    pid = rng.choice(list(by_item.values()) or list(products))
    calls = {
        "calculate": {"expression": rng.choice(["2 + 2", "(10.5 - 3) * 2", "100 / 3", "7 / 0", "2 ** 8",
                                                "1.5 * (2 + 3) / 4", "abc + 1", "12 - 4.75"])},
        "cancel_pending_order": {"order_id": oid, "reason": rng.choice(["no longer needed", "ordered by mistake",
                                                                        "other"])},
        "exchange_delivered_order_items": {"order_id": oid, "item_ids": picked, "new_item_ids": new,
                                           "payment_method_id": pay},
        "find_user_id_by_email": {"email": rng.choice([u["email"], u["email"].upper(), "x@example.com"])},
        "find_user_id_by_name_zip": {"first_name": u["name"]["first_name"].lower(),
                                     "last_name": u["name"]["last_name"],
                                     "zip": rng.choice([u["address"]["zip"], "00000"])},
        "get_order_details": {"order_id": oid},
        "get_product_details": {"product_id": pid},
        "get_user_details": {"user_id": uid},
        "list_all_product_types": {},
        "modify_pending_order_address": {"order_id": oid, **address(rng)},
        "modify_pending_order_items": {"order_id": oid, "item_ids": picked, "new_item_ids": new,
                                       "payment_method_id": pay},
        "modify_pending_order_payment": {"order_id": oid, "payment_method_id": pay},
        "modify_user_address": {"user_id": uid, **address(rng)},
        "return_delivered_order_items": {"order_id": oid, "item_ids": picked, "payment_method_id": pay},
        "think": {"thought": "hmm"},
        "transfer_to_human_agents": {"summary": "help"},
        "get_item_details": {"item_id": "1008292230"},  # not a v1 tool
    }
    writes = [n for n in calls if n.startswith(("cancel", "exchange", "modify", "return"))]
    name = rng.choice(writes) if rng.random() < 0.5 else rng.choice(list(calls))
    return name, calls[name]


def airline_call(rng, data):
    users, reservations, flights = data["users"], data["reservations"], data["flights"]
    uid = rng.choice(list(users))
    u = users[uid]
    rid = rng.choice(u["reservations"] or list(reservations))
    r = reservations[rid]
    pay = rng.choice(list(u["payment_methods"]) + ["credit_card_0000000"] * (rng.random() < 0.1))
    f = flights[rng.choice(list(flights))]
    date = rng.choice(list(f["dates"]))
    cabin = rng.choice(["basic_economy", "economy", "business"])
    legs = [{"flight_number": f["flight_number"], "date": date}]
    if rng.random() < 0.3:
        f2 = rng.choice([g for g in flights.values() if g["origin"] == f["destination"]] or [f])
        legs.append({"flight_number": f2["flight_number"], "date": rng.choice(list(f2["dates"]))})
    people = [{"first_name": rng.choice(["Ann", "Bo"]), "last_name": "Lee", "dob": "1990-01-01"}
              for _ in range(rng.randint(1, 2))]
    price = 0
    for leg in legs:
        day = flights[leg["flight_number"]]["dates"][leg["date"]]
        price += day.get("prices", {}).get(cabin, 0) * len(people)
    insurance, bags = rng.choice(["yes", "no"]), rng.randint(0, 2)
    price += 30 * len(people) * (insurance == "yes") + 50 * bags
    method = u["payment_methods"][pay] if pay in u["payment_methods"] else {"source": "x"}
    amount = price if rng.random() < 0.7 else price + rng.choice([-1, 1])
    if method["source"] in ("gift_card", "certificate") and rng.random() < 0.5:  # split with the first card
        part = min(method["amount"], amount)
        cards = [m for m in u["payment_methods"] if m.startswith("credit_card")] or [pay]
        paid = [{"payment_id": pay, "amount": part}, {"payment_id": cards[0], "amount": amount - part}]
    else:
        paid = [{"payment_id": pay, "amount": amount}]
    day_n = rng.randint(1, 30)
    new_legs = [{"flight_number": leg["flight_number"], "date": leg["date"]} for leg in r["flights"]]
    if new_legs and rng.random() < 0.7:
        same = [g for g in flights.values() if g["origin"] == flights[new_legs[0]["flight_number"]]["origin"]
                and g["destination"] == flights[new_legs[0]["flight_number"]]["destination"]]
        g = rng.choice(same)
        new_legs[0] = {"flight_number": g["flight_number"], "date": rng.choice(list(g["dates"]))}
    calls = {
        "book_reservation": {"user_id": uid, "origin": f["origin"],
                             "destination": flights[legs[-1]["flight_number"]]["destination"],
                             "flight_type": "one_way",
                             "cabin": cabin, "flights": legs, "passengers": people, "payment_methods": paid,
                             "total_baggages": bags + 1, "nonfree_baggages": bags, "insurance": insurance},
        "calculate": {"expression": rng.choice(["2 + 2", "100 / 3", "7 / 0", "(250 - 30) * 2", "x"])},
        "cancel_reservation": {"reservation_id": rid},
        "get_reservation_details": {"reservation_id": rid},
        "get_user_details": {"user_id": uid},
        "list_all_airports": {},
        "search_direct_flight": {"origin": f["origin"], "destination": f["destination"],
                                 "date": f"2024-05-{day_n:02d}"},
        "search_onestop_flight": {"origin": f["origin"], "destination": rng.choice(["JFK", "SEA", "LAX", "ORD"]),
                                  "date": f"2024-05-{day_n:02d}"},
        "send_certificate": {"user_id": uid, "amount": rng.choice([50, 100, 150.5])},
        "think": {"thought": "hmm"},
        "transfer_to_human_agents": {"summary": "help"},
        "update_reservation_baggages": {"reservation_id": rid, "total_baggages": rng.randint(0, 4),
                                        "nonfree_baggages": rng.randint(0, 3), "payment_id": pay},
        "update_reservation_flights": {"reservation_id": rid, "cabin": rng.choice([r["cabin"], cabin]),
                                       "flights": new_legs, "payment_id": pay},
        "update_reservation_passengers": {"reservation_id": rid, "passengers": r["passengers"][:1] + people[:len(
            r["passengers"]) - 1] if rng.random() < 0.8 else people + people},
        "get_order_details": {"order_id": "#W0000000"},  # not an airline tool
    }
    writes = ["book_reservation", "cancel_reservation", "send_certificate", "update_reservation_baggages",
              "update_reservation_flights", "update_reservation_passengers"]
    name = rng.choice(writes) if rng.random() < 0.5 else rng.choice(list(calls))
    return name, calls[name]


def broken(rng, name, kwargs):
    """One way to break a call: a missing, an unexpected or a junk argument, or a wrong type."""
    kwargs = dict(kwargs)
    how = rng.choice(["missing", "extra", "junk", "junk", "type"])
    if how == "missing" and kwargs:
        kwargs.pop(rng.choice(list(kwargs)))
    elif how == "extra":
        kwargs["note"] = "x"
    elif kwargs:
        key = rng.choice(list(kwargs))
        kwargs[key] = junk(rng) if how == "junk" else rng.choice([7, None, ["a"]])
    return name, kwargs


def record_calls(domain, n_episodes, calls_per_episode, seed):
    from tau_bench.types import Action
    env, rng = v1_env(domain), random.Random(seed)
    make = retail_call if domain == "retail" else airline_call
    episodes, crashed = [], 0
    for _ in range(n_episodes):
        env.data = env.data_load_func()
        calls = []
        for _ in range(calls_per_episode):
            name, kwargs = make(rng, env.data)
            if rng.random() < 0.3:
                name, kwargs = broken(rng, name, kwargs)
            # a transfer ends v1's episode, whose reward then replays a task's gold on env.data: the data it ended with
            end = (digest(env.data), env.get_data_hash()) if name in env.terminate_tools else None
            try:
                obs = env.step(Action(name=name, kwargs=kwargs)).observation
            except Exception:  # noqa: BLE001 - v1 itself fails (send_certificate's None): not recorded
                crashed += 1
                break
            calls.append([name, kwargs, shown(obs), v1_error(obs), end[0] if end else digest(env.data)])
            if end:
                break
        episodes.append({"calls": calls, "v1_hash": end[1] if end else env.get_data_hash()})
    return episodes, crashed


def gold_hashes(domain, split):
    env, out = v1_env(domain, split), []
    for task in env.tasks:  # as v1's calculate_reward: fresh data, every gold action but the terminating ones
        env.data = env.data_load_func()
        for action in task.actions:
            if action.name not in env.terminate_tools:
                env.step(action)
        out.append(env.get_data_hash())
    return out


def export(domain, v1, dest):
    """v1's data, wiki and task lists in env.Tau1's layout."""
    src, d = Path(v1) / "tau_bench" / "envs" / domain, Path(dest) / domain
    d.mkdir(parents=True, exist_ok=True)
    for t in TABLES[domain]:
        shutil.copy(src / "data" / f"{t}.json", d / f"{t}.json")
    shutil.copy(src / "wiki.md", d / "wiki.md")
    for split in SPLITS[domain]:
        (d / f"tasks_{split}.json").write_text(json.dumps([t.model_dump() for t in v1_tasks(domain, split)], indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--v1", required=True, help="a checkout of sierra-research/tau-bench")
    p.add_argument("--commit", default="59a200c6d575d595120f1cb70fea53cef0632f6b",
                   help="the checkout's commit (a git archive has no .git)")
    p.add_argument("--export", default=None, help="also write v1's data in env.Tau1's layout here")
    p.add_argument("--episodes", type=int, default=180, help="random episodes per domain")
    p.add_argument("--calls", type=int, default=20, help="calls per random episode")
    p.add_argument("--seed", type=int, default=0, help="seeds the random calls")
    p.add_argument("--calls-only", action="store_true", help="keep gold_hashes.json, record the calls anew")
    a = p.parse_args()
    sys.path.insert(0, str(Path(a.v1).resolve()))
    HERE.mkdir(exist_ok=True)
    counts = {}
    if a.export:
        for domain in SPLITS:
            export(domain, a.v1, a.export)
    if a.calls_only:
        gold = json.loads((HERE / "gold_hashes.json").read_text())
    else:
        gold = {d: {s: gold_hashes(d, s) for s in SPLITS[d]} for d in SPLITS}
        (HERE / "gold_hashes.json").write_text(json.dumps(gold, indent=0) + "\n")
    for domain in SPLITS:
        episodes, crashed = record_calls(domain, a.episodes, a.calls, a.seed)
        with gzip.open(HERE / f"calls_{domain}.json.gz", "wt") as f:
            json.dump(episodes, f)
        counts[domain] = {"calls": sum(len(e["calls"]) for e in episodes), "episodes": len(episodes),
                          "v1_crashed": crashed, "errors": sum(c[3] for e in episodes for c in e["calls"]),
                          "gold_tasks": {s: len(h) for s, h in gold[domain].items()}}
    (HERE / "provenance.json").write_text(json.dumps({
        "repository": "https://github.com/sierra-research/tau-bench", "commit": a.commit,
        "command": "python tests/tau1_record.py --v1 <tau-bench at 59a200c> --export <folder>",
        "python": sys.version.split()[0],
        "counts": counts}, indent=1) + "\n")
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
