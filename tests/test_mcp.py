"""The MCP server/client must be a transparent transport for env's tools: same schemas, same results."""
import json
import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("mcp", reason="mcp SDK not installed")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import env  # noqa: E402
from synth import MCPToolClient  # noqa: E402

ADDR = {"address1": "1 Elm Street", "address2": "Suite 2", "city": "Austin", "country": "USA", "state": "TX", "zip": "78701"}
SHIRT_BLUE = {"name": "T-Shirt", "product_id": "100", "item_id": "1001", "price": 50.88,
              "options": {"color": "blue", "size": "M"}}


def tiny_db():
    """Two users, one product, a pending and a delivered order, in tau2's retail schema."""
    variants = {"1001": {"item_id": "1001", "options": {"color": "blue", "size": "M"}, "available": True, "price": 50.88},
                "1002": {"item_id": "1002", "options": {"color": "red", "size": "L"}, "available": True, "price": 53.0}}
    return {
        "products": {"100": {"name": "T-Shirt", "product_id": "100", "variants": variants}},
        "users": {
            "ann_lee_1": {"user_id": "ann_lee_1", "name": {"first_name": "Ann", "last_name": "Lee"}, "address": ADDR,
                          "email": "ann.lee@example.com",
                          "payment_methods": {"gift_card_7": {"source": "gift_card", "id": "gift_card_7", "balance": 20.0},
                                              "credit_card_8": {"source": "credit_card", "id": "credit_card_8",
                                                                "brand": "visa", "last_four": "4242"}},
                          "orders": ["#W0000001", "#W0000002"]},
            "bo_ng_2": {"user_id": "bo_ng_2", "name": {"first_name": "Bo", "last_name": "Ng"}, "address": ADDR,
                        "email": "bo.ng@example.com",
                        "payment_methods": {"paypal_9": {"source": "paypal", "id": "paypal_9"}}, "orders": []},
        },
        "orders": {
            "#W0000001": {"order_id": "#W0000001", "user_id": "ann_lee_1", "address": ADDR, "items": [SHIRT_BLUE],
                          "status": "pending", "fulfillments": [],
                          "payment_history": [{"transaction_type": "payment", "amount": 50.88,
                                               "payment_method_id": "gift_card_7"}]},
            "#W0000002": {"order_id": "#W0000002", "user_id": "ann_lee_1", "address": ADDR, "items": [SHIRT_BLUE],
                          "status": "delivered",
                          "fulfillments": [{"tracking_id": ["123456789012"], "item_ids": ["1001"]}],
                          "payment_history": [{"transaction_type": "payment", "amount": 50.88,
                                               "payment_method_id": "credit_card_8"}]},
        },
    }


NEW_ADDR = {"address1": "9 Oak Road", "address2": "", "city": "Boston", "state": "MA", "country": "USA", "zip": "02110"}
CALLS = [
    ("find_user_id_by_email", {"email": "ANN.LEE@example.com"}),
    ("get_user_details", {"user_id": "ann_lee_1"}),
    ("get_order_details", {"order_id": "#W0000001"}),
    ("get_product_details", {"product_id": "100"}),
    ("cancel_pending_order", {"order_id": "#W0000001", "reason": "no longer needed"}),   # write
    ("get_order_details", {"order_id": "#W0000001"}),                                    # shows the write
    ("get_user_details", {"user_id": "ann_lee_1"}),                                      # refunded gift card
    ("cancel_pending_order", {"order_id": "#W0000001", "reason": "no longer needed"}),   # tau2 error
    ("modify_user_address", {"user_id": "bo_ng_2", **NEW_ADDR}),
    ("get_order_details", {}),                                                           # missing argument
    ("get_order_details", {"order_id": "#W0000002", "verbose": True}),                   # extra argument
    ("get_order_details", {"order_id": 2}),                                              # wrong type
    ("get_order_details", {"order_id": "#W9999999"}),                                    # not found
    ("refund_everything", {"order_id": "#W0000002"}),                                    # unknown tool
    ("calculate", {"expression": "50.88 * 2"}),
    ("list_all_product_types", {}),
]


@pytest.fixture
def db_path(tmp_path):
    path = tmp_path / "db.json"
    path.write_text(json.dumps(tiny_db()))
    return path


def server_pids(db_path):
    """Pids of our children whose command line names db_path (Linux /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and str(db_path) in cmd:
            pids.append(int(proc.name))
    return pids


def test_mcp_matches_in_process(db_path):
    if not Path("/proc/self/stat").exists():
        pytest.skip("needs /proc to find the server process")
    local = env.load_db(db_path)
    with MCPToolClient(db_path) as client:
        pids = server_pids(db_path)
        assert len(pids) == 1
        assert client.list_tools() == env.TOOL_SCHEMAS

        results = []
        for name, args in CALLS:
            remote, expected = client.call_tool(name, args), env.call_tool(local, name, args)
            assert remote == expected, (name, args)
            results.append(remote)
        # The sequence really exercises state and errors, not just reads of an unchanged db.
        assert results[2] != results[5] and '"cancelled"' in results[5][0]
        assert [is_error for _, is_error in results] == [i in (7, 9, 10, 11, 12, 13) for i in range(len(CALLS))]
        assert client.get_db() == json.loads(json.dumps(local))

        # Non-dict arguments (MCP carries objects only) still answer exactly as env does.
        for name, args in [("get_order_details", '{"order_id": "#W0000002"}'), ("get_order_details", "#W0000002"),
                           ("get_order_details", ["#W0000002"]), ("list_all_product_types", None),
                           ("no_such_tool", 3)]:
            assert client.call_tool(name, args) == env.call_tool(local, name, args), (name, args)

        # reset(): a new episode on the same server starts from the pristine db.
        client.reset()
        fresh = env.load_db(db_path)
        assert client.get_db() == fresh
        assert client.call_tool("get_order_details", {"order_id": "#W0000001"}) == \
            env.call_tool(fresh, "get_order_details", {"order_id": "#W0000001"})
    assert not Path(f"/proc/{pids[0]}").exists(), "server process survived close()"


def test_episodes_are_isolated_and_expire(db_path):
    command = [sys.executable, str(REPO / "env.py"), "--mcp-server", "--max-episodes", "1"]
    with MCPToolClient(db_path, command=command) as client:
        cancel = ("cancel_pending_order", {"order_id": "#W0000001", "reason": "ordered by mistake"})
        first = client.episode
        assert client.call_tool(*cancel)[1] is False
        client.reset()
        assert client.call_tool(*cancel)[1] is False   # a fresh copy: the order is pending again
        client.episode = first                          # evicted by the second episode (cap 1)
        content, is_error = client.call_tool("get_order_details", {"order_id": "#W0000001"})
        assert is_error and "expired" in content


def test_tau2_gold_actions_over_mcp():
    """tau2's own db and gold actions (real sizes, floats, errors): same results and end state over MCP."""
    retail = REPO.parent / "shared" / "tau2" / "retail"
    if not (retail / "db.json").exists():
        pytest.skip("../shared/tau2/retail absent")
    initial = env.load_db(retail / "db.json")
    tasks = env.load_tasks(retail / "tasks.json")[:6]
    with MCPToolClient(retail / "db.json") as client:
        for task in tasks:
            client.reset()
            local = json.loads(json.dumps(initial))
            for action in task["evaluation_criteria"]["actions"]:
                name, args = action["name"], action["arguments"]
                assert client.call_tool(name, args) == env.call_tool(local, name, args), (task["id"], name)
            assert client.get_db() == local, task["id"]  # plain equality: stricter than db_hash, and cheaper
