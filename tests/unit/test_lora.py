"""LoRA in one process (issue 41): ``model.lora`` refuses a rank vLLM cannot serve; a wrapped
learner starts as the full model (B = 0) and moves only its adapters; the reference is the base
until a reset, then the adapters' snapshot, swapped in and out of the policy for its forward; a
checkpoint of a LoRA learner resumes bit for bit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from learner.checkpoint import Checkpointer
from learner.reference import AdapterSnapshot, ReferencePolicy
from learner.trainer import Learner
from reval import lora
from reval.config import AlgoConfig, ConfigError, LearnerConfig, LoraConfig, load_config
from tests.unit.test_packing import CPU, EOS, PAD, tiny, trajs

RANK = 8


def _learner(rank: int = RANK, seed: int = 0, lr: float = 1e-2) -> Learner:
    """The tiny policy's learner (ReVal: it uses the reference), wrapped with ``rank`` adapters
    when ``rank > 0``."""
    model = tiny(seed)
    if rank:
        model = lora.wrap(model, LoraConfig(rank=rank))
    return Learner(model=model, learner_cfg=LearnerConfig(micro_batch_size=4, lr=lr),
                   algo=AlgoConfig(name="reval", beta=0.5), pad_id=PAD, eos_id=EOS,
                   device=CPU)  # fmt: skip


def _batch(seed: int = 1) -> list:
    return trajs(8, seed=seed)


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lora.adapter_parameters(model)}


def _ref_values(ref: ReferencePolicy, batch: list) -> torch.Tensor:
    """``[B, 2]``: each trajectory's (log pi_ref(tau), V_ref(s1)), computed afresh."""
    fresh = copy.deepcopy(batch)
    for t in fresh:
        t.ref_version = -1
    ref.fill(fresh, CPU)
    return torch.tensor([[t.ref_logprob_sum, t.ref_value] for t in fresh], dtype=torch.float64)


def _plain_reference(model: torch.nn.Module, like: Learner) -> ReferencePolicy:
    """A full model's reference (a frozen copy of ``model``), laid out as ``like``'s."""
    return ReferencePolicy(model, PAD, EOS, 4, packed=like.packed, auto_pack=like.auto_pack,
                           share=like.share_prompts)  # fmt: skip


# -- config ---------------------------------------------------------------------------------


def test_a_rank_vllm_cannot_serve_is_refused_naming_the_nearest():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["model.lora.rank=24"], environ={})
    message = str(err.value)
    assert "model.lora.rank" in message and "24" in message
    assert "nearest are 16, 32" in message
    cfg = load_config(overrides=["model.lora.rank=32"], environ={})
    assert cfg.model.lora.rank == 32 and cfg.model.lora.enabled
    assert cfg.model.lora.scale_alpha == 64.0  # alpha unset: 2 * rank
    default = load_config(environ={})
    assert default.model.lora.rank == 0 and not default.model.lora.enabled


# -- the learner ----------------------------------------------------------------------------


def test_lora_starts_as_the_full_model_and_moves_only_adapters():
    full, lrn = _learner(rank=0), _learner()
    assert lora.is_lora(lrn.model) and not lora.is_lora(full.model)
    got_full = full.update(_batch())
    got = lrn.update(_batch())
    # B = 0: the same model, so the same loss and terms (the grad norm is over other params).
    assert not got.skipped and not got_full.skipped
    keys = set(got_full.metrics) - {"grad_norm"}
    assert keys == set(got.metrics) - {"grad_norm"} and "loss" in keys
    for k in keys:
        assert got.metrics[k] == pytest.approx(got_full.metrics[k], rel=1e-6, abs=1e-7), k
    torch.testing.assert_close(got.delta, got_full.delta, rtol=1e-6, atol=1e-7)


def test_an_update_reaches_only_the_adapters():
    lrn = _learner()
    named = dict(lrn.model.named_parameters())
    adapters = dict(lora.adapter_parameters(lrn.model))
    assert adapters and len(adapters) < len(named)
    assert {n for n, p in named.items() if p.requires_grad} == set(adapters)
    optimized = [p for g in lrn.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(adapters)
    assert {id(p) for p in optimized} == {id(p) for p in adapters.values()}
    before = {n: p.detach().clone() for n, p in named.items()}
    assert all(torch.all(p == 0) for n, p in adapters.items() if ".lora_B." in n)

    assert not lrn.update(_batch()).skipped
    for n, p in named.items():
        if n in adapters:
            continue
        assert p.grad is None, n
        assert torch.equal(p, before[n]), n
    # B gets the gradient at B = 0 (A's is B^T times something: zero) and every B moves.
    lora_b = [n for n in adapters if ".lora_B." in n]
    assert lora_b and all(adapters[n].grad.abs().sum() > 0 for n in lora_b)
    assert all(not torch.equal(adapters[n], before[n]) for n in lora_b)


# -- the reference --------------------------------------------------------------------------


def test_the_reference_is_the_base_then_the_snapshot_at_reset():
    lrn = _learner(lr=5e-2)
    ref = lrn.reference
    assert isinstance(ref.model, AdapterSnapshot) and ref.version == 0
    # The snapshot is the adapters' size: no copy of the model.
    snap = [p.numel() for p in ref.model.parameters()]
    adapter = [p.numel() for _, p in lora.adapter_parameters(lrn.model)]
    assert snap == adapter
    assert sum(snap) < 0.25 * sum(p.numel() for p in lrn.model.parameters())
    base = _ref_values(_plain_reference(tiny(0), lrn), _batch(2))

    for seed in (1, 3, 4):  # train the adapters away from zero
        assert not lrn.update(_batch(seed)).skipped
    trained = _adapters(lrn.model)
    # The policy now differs from the base (else the checks below prove nothing) ...
    merged = copy.deepcopy(lrn.model).merge_and_unload()
    policy_now = _ref_values(_plain_reference(merged, lrn), _batch(2))
    assert (policy_now - base).abs().max() > 1e-3
    # ... and version 0 is still the base, with the policy's adapters put back after the fill.
    torch.testing.assert_close(_ref_values(ref, _batch(2)), base, rtol=1e-5, atol=1e-5)
    assert lrn.model.training
    for n, p in lora.adapter_parameters(lrn.model):
        assert torch.equal(p, trained[n]), n

    lrn.reset_reference()
    assert ref.version == 1
    names = [n for n, _ in lora.adapter_parameters(lrn.model)]
    for held, n in zip(ref.model.parameters(), names, strict=True):
        assert torch.equal(held, trained[n]), n
    torch.testing.assert_close(_ref_values(ref, _batch(2)), policy_now, rtol=1e-5, atol=1e-5)
    for n, p in lora.adapter_parameters(lrn.model):
        assert torch.equal(p, trained[n]), n
    # The policy moves on; the reference stays where it was reset.
    assert not lrn.update(_batch(5)).skipped
    assert any(not torch.equal(p, trained[n]) for n, p in lora.adapter_parameters(lrn.model))
    torch.testing.assert_close(_ref_values(ref, _batch(2)), policy_now, rtol=1e-5, atol=1e-5)


# -- checkpoints ----------------------------------------------------------------------------


def _checkpointer(lrn: Learner, path: Path) -> Checkpointer:
    return Checkpointer(path, lrn.model, lrn.reference.model, lrn.optimizer, parts=[lrn])


def test_a_lora_checkpoint_resumes_bit_for_bit(tmp_path: Path):
    first = _learner()
    assert not first.update(_batch(1)).skipped
    first.reset_reference()  # the snapshot differs from the initial adapters
    assert not first.update(_batch(3)).skipped
    _checkpointer(first, tmp_path).save()

    second = _learner(seed=0)  # the same base, other adapters: the load must restore them all
    with torch.no_grad():
        for _, p in lora.adapter_parameters(second.model):
            p.add_(torch.randn_like(p))
    _checkpointer(second, tmp_path).load()
    assert (second.step, second.reference.version) == (2, 1)
    assert (first.step, first.reference.version) == (2, 1)
    for (n, a), (m, b) in zip(
        first.model.state_dict().items(), second.model.state_dict().items(), strict=True
    ):
        assert n == m and torch.equal(a, b), n
    for a, b in zip(first.reference.model.parameters(), second.reference.model.parameters(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)

    got_first = first.update(_batch(4))
    got_second = second.update(_batch(4))
    assert got_second.metrics == got_first.metrics
    assert got_second.metrics["loss"] == got_first.metrics["loss"]
    for (n, a), (_, b) in zip(
        first.model.named_parameters(), second.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), n  # AdamW's moments came back too


def test_adapters_on_embeddings_are_refused():
    """peft names embedding adapters ``lora_embedding_A``/``B`` (another layout): they would be
    neither published as adapters nor merged, so they are refused at wrap, on an untied model."""
    from reval.config import LoraConfig, TinyModelConfig
    from reval.policy import build_tiny_model

    model = build_tiny_model(TinyModelConfig(), 40, 0, 1, seed=0)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with pytest.raises(ValueError, match=r"adapters on embeddings \(.*embed_tokens\)"):
        lora.wrap(model, LoraConfig(rank=8, target_modules=["embed_tokens", "q_proj"]))


def test_a_lora_checkpoint_holds_the_adapters_not_the_base(tmp_path: Path):
    """The base is the config's model (a 7B base would be 28 GB of fp32 per checkpoint), with
    its fingerprint beside the adapters: loading into another base is refused in one line."""
    from torch.distributed.checkpoint import FileSystemReader

    first = _learner()
    assert not first.update(_batch(1)).skipped
    path = _checkpointer(first, tmp_path).save()
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys == {f"model.{n}" for n, _ in lora.adapter_parameters(first.model)}
    assert "lora_base" in keys
    other = _learner(seed=1)  # another base
    with pytest.raises(ValueError, match="trained on another base"):
        _checkpointer(other, tmp_path).load()


def test_activation_checkpointing_changes_nothing_of_a_lora_update():
    """Adapters under activation checkpointing (non-reentrant, as the learner enables it): the
    layers' forwards run again in the backward, and the update is the one without it (the
    frozen embeddings give the checkpointed layers no input that needs a gradient: the
    reentrant variant would have cut the adapters' gradients off there)."""
    from reval.policy import enable_checkpointing

    plain, ckpt = _learner(), _learner()
    with torch.no_grad():  # (the same A: peft draws it from the global generator)
        for (_, p), (_, q) in zip(lora.adapter_parameters(ckpt.model),
                                  lora.adapter_parameters(plain.model), strict=True):  # fmt: skip
            p.copy_(q)
    enable_checkpointing(ckpt.model)  # type: ignore[arg-type]
    calls = {"plain": 0, "ckpt": 0}
    for name, lrn in (("plain", plain), ("ckpt", ckpt)):
        mlp = lrn.model.get_base_model().model.layers[0].mlp
        forward = mlp.forward

        def counted(*args, name=name, forward=forward, **kwargs):  # (a hook would not count
            calls[name] += 1  # the recompute: it runs under the checkpoint's own call)
            return forward(*args, **kwargs)

        mlp.forward = counted
    got, want = ckpt.update(_batch()), plain.update(_batch())
    assert calls["ckpt"] > calls["plain"] > 0  # (recomputed in the backward)
    assert got.metrics["loss"] == pytest.approx(want.metrics["loss"], rel=1e-6)
    for (n, p), (m, q) in zip(lora.adapter_parameters(ckpt.model),
                              lora.adapter_parameters(plain.model), strict=True):  # fmt: skip
        assert n == m
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    assert any(
        ".lora_B." in n and p.abs().sum() > 0 for n, p in lora.adapter_parameters(ckpt.model)
    )


def test_reval_train_trains_adapters_and_exports_them(tmp_path: Path, monkeypatch):
    """``reval train`` with ``model.lora.rank``: its learner trains a wrapped policy whose only
    gradients are the adapters' (pretraining's, on the base, are gone), and its ``final/``
    holds that policy's adapters as a PEFT directory and the merged checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import services.train as embedded
    from learner.export import ADAPTER_DIR
    from services.train import train
    from tests.unit.test_trackers import TINY

    made: list[Learner] = []

    class Kept(Learner):
        def __post_init__(self) -> None:
            super().__post_init__()
            made.append(self)

    monkeypatch.setattr(embedded, "Learner", Kept)
    sets = [*TINY, f"output_dir={tmp_path}", "model.lora.rank=8", "learner.rounds=2"]
    cfg = load_config(overrides=sets, environ={})
    train(cfg)
    (learner,) = made
    model = learner.model
    assert lora.is_lora(model) and learner.step > 0
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and with_grad <= {n for n, _ in lora.adapter_parameters(model)}
    adapter = cfg.paths.final / ADAPTER_DIR
    assert (adapter / "adapter_config.json").is_file()
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    trained = [p for _, p in lora.adapter_parameters(model)]
    assert len(saved) == len(trained)  # (peft's file names differ: compared by their sums)
    sums = sorted(round(float(t.double().sum()), 6) for t in saved.values())
    assert sums == sorted(round(float(p.detach().double().sum()), 6) for p in trained)
    merged = AutoModelForCausalLM.from_pretrained(cfg.paths.final)
    assert not lora.is_lora(merged)


def test_a_frozen_parameter_s_leftover_gradient_is_not_in_the_update_s_norm():
    """A gradient left on the frozen base (``reval train`` pretrains the whole model, then
    wraps it) is not this update's: the grad norm, and so the clipping, are the adapters'."""
    clean, stale = _learner(), _learner()
    with torch.no_grad():
        for (_, p), (_, q) in zip(lora.adapter_parameters(stale.model),
                                  lora.adapter_parameters(clean.model), strict=True):  # fmt: skip
            p.copy_(q)
    for p in stale.model.parameters():
        if not p.requires_grad:
            p.grad = torch.ones_like(p)
    got, want = stale.update(_batch()), clean.update(_batch())
    assert got.metrics["grad_norm"] == pytest.approx(want.metrics["grad_norm"], rel=1e-6)
    for (_, p), (_, q) in zip(lora.adapter_parameters(stale.model),
                              lora.adapter_parameters(clean.model), strict=True):  # fmt: skip
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-8)
