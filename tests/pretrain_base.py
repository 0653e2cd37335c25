"""
Builds the committed tiny base, tests/tiny_base: the CPU demo's pretrained model (MUA-RL starts from Qwen3; the demo
from this ~1M-parameter Qwen3). It ran once; the repository commits the result, and every demo run starts from it.

    python synth.py                                                     # the generated shop and its tasks -> data/
    python tests/pretrain_base.py --data data/sft.jsonl --out tests/tiny_base --overwrite   # about 6.5 minutes

A BPE trained on the SFT file's conversations (sft.make_tiny), the copy warm-up (sft.copy_warmup), then language
modelling on shop documents of the training users (shop.json and train_tasks.jsonl beside --data; ids and names
re-drawn in every document) with copy sequences mixed in. No test user, test task or conversation enters the weights.
Serving a customer means copying ids across hundreds of tokens, and a model this small learns to copy only after a
phase transition whose timing machine and seed decide: doing it once, here, takes it out of the demo.
"""
import argparse
import json
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import env  # noqa: E402
from rollout import check_flags, claim_or_stop  # noqa: E402
from sft import (CopyMix, TinyConfig, copy_accuracy, copy_warmup, load_conversations, lr_at, make_tiny,  # noqa: E402
                 micro_loss, redraw_ids)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/sft.jsonl", help="synth.py's conversations (shop.json and "
                   "train_tasks.jsonl beside)")
    p.add_argument("--out", default="tests/tiny_base", help="the base's folder, written whole")
    p.add_argument("--vocab-size", type=int, default=2048, help="BPE tokens, plus 1100 digit-chunk tokens")
    p.add_argument("--d-model", type=int, default=128, help="hidden size")
    p.add_argument("--n-layer", type=int, default=4, help="layers")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--copy-warmup", type=int, default=900, help="at most this many short copy steps, + 1/3 long")
    p.add_argument("--copy-mix", type=int, default=4, help="copy sequences mixed into every step")
    p.add_argument("--steps", type=int, default=400, help="language-modelling steps on shop documents")
    p.add_argument("--batch-size", type=int, default=8, help="documents per step")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--max-len", type=int, default=512, help="tokens per document")
    p.add_argument("--seed", type=int, default=0, help="seeds the tokenizer's model, the curriculum and the documents")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier base in --out (else refused)")
    a = p.parse_args(argv)
    check_flags(p, a, [("--steps", a.steps >= 1, ">= 1"), ("--batch-size", a.batch_size >= 1, ">= 1"),
                       ("--lr", a.lr > 0, "> 0"), ("--copy-warmup", a.copy_warmup >= 0, ">= 0")])
    claim_or_stop(p, a.out, False, a.overwrite)
    tiny = TinyConfig(a.vocab_size, a.d_model, a.n_layer, a.n_head, a.copy_warmup)
    return pretrain_base(data=a.data, out=a.out, tiny=tiny, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                         warmup=a.warmup, max_len=a.max_len, copy_mix=a.copy_mix, seed=a.seed)


def training_users(tasks):
    """The users a split's generated tasks belong to (a task's script names its user)."""
    return sorted({t["script"]["user_id"] for t in tasks if (t.get("script") or {}).get("user_id")})


def shop_document(db, user_id, rng):
    """One walk through a user's records, written as tool calls and their results: find the user (by e-mail,
    or by name and zip), read the details, then some of the orders they list and a product or item each order
    lists. Every call's arguments appear earlier in the text, as an agent's do: the text a base model of this
    shop would have read, and copying practice in the conversations' own formats."""
    u = db["users"][user_id]
    find = rng.choice([("find_user_id_by_email", {"email": u["email"]}),
                       ("find_user_id_by_name_zip", {"first_name": u["name"]["first_name"],
                                                     "last_name": u["name"]["last_name"], "zip": u["address"]["zip"]})])
    calls = [find, ("get_user_details", {"user_id": user_id})]
    for oid in rng.sample(u["orders"], min(len(u["orders"]), rng.randint(1, 3))):
        item = rng.choice(db["orders"][oid]["items"])
        calls.append(("get_order_details", {"order_id": oid}))
        calls.append(rng.choice([("get_product_details", {"product_id": item["product_id"]}),
                                 ("get_item_details", {"item_id": item["item_id"]})]))
    parts = []
    for name, args in calls:
        result, _ = env.call_tool(db, name, args)
        parts.append("<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>\n" + result)
    return "\n".join(parts)


def pretrain_base(*, data, out, tiny, steps, batch_size, lr, warmup, max_len, copy_mix, seed):
    """Pretrain the tiny base on the CPU: a tokenizer (trained on the SFT file's conversations and the shop
    text), the copy warm-up, then `steps` steps of language modelling on shop documents of the training users
    (shop.json and train_tasks.jsonl beside `data`; ids and names re-drawn in every document) with copy
    sequences mixed in. Written to `out` as one save_pretrained folder, atomically, with its metrics and recipe.
    No test user, test task or conversation enters the model's weights. -> (model, tokenizer)."""
    folder = os.path.dirname(data) or "."
    db = env.load_db(os.path.join(folder, "shop.json"))
    users = training_users(env.load_tasks(os.path.join(folder, "train_tasks.jsonl")))
    if not users:
        raise SystemExit(f"sft.py --pretrain: no generated train tasks (with a script naming its user) in {folder}")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    # the tokenizer and the untrained model exactly as `--model tiny` makes them (merges from the conversations)
    tok, model = make_tiny(load_conversations(data), tiny.vocab_size, tiny.d_model, tiny.n_layer, tiny.n_head, seed)
    t0 = time.time()
    acc, short = copy_warmup(model, tok, tiny.copy_warmup, lr, "cpu", seed)
    recipe = {"seed": seed, "users": len(users), "copy_short_steps": short, "copy_acc_after_warmup": acc,
              "copy_warmup_s": round(time.time() - t0, 1), "steps": steps, "batch_size": batch_size, "lr": lr,
              "max_len": max_len, "vocab": len(tok), "params": sum(p.numel() for p in model.parameters())}
    # the shop text is where long-range copying forms: the committed base copied 0.14 of ids after the warm-up
    # (its long stage collapsed, as it often does) and 0.925 after these steps (tests/tiny_base/pretrain.json)
    mix = CopyMix(tok, copy_mix, seed, "cpu") if copy_mix else None
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    tmp = out.rstrip(os.sep) + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "metrics.jsonl"), "w") as log:
        for step in tqdm(range(steps), desc="pretrain"):
            docs = [redraw_ids(shop_document(db, rng.choice(users), rng), rng) for _ in range(batch_size)]
            batch = [(ids, [1] * len(ids)) for ids in (tok(d)["input_ids"][:max_len] for d in docs)]
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup)
            loss = micro_loss(model, batch, sum(len(i) - 1 for i, _ in batch), "cpu")
            total = loss + (mix.loss(model, step, 0) if mix else 0.0)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec = {"step": step + 1, "lm_loss": round(float(loss.detach()), 4)}
            if (step + 1) % 100 == 0 or step + 1 == steps:
                rec["copy_acc"] = copy_accuracy(model, tok, "cpu")
            log.write(json.dumps(rec) + "\n")
    recipe.update(lm_loss=rec["lm_loss"], copy_acc=copy_accuracy(model, tok, "cpu"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, "pretrain.json"), "w") as f:
        json.dump(recipe, f, indent=1)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"tests/pretrain_base.py: {out} ({recipe['params']:,} parameters): copy accuracy {recipe['copy_acc']:.3f}, "
          f"shop-text loss {recipe['lm_loss']:.3f}", flush=True)
    return model, tok


if __name__ == "__main__":
    main()
