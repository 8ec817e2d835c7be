"""Generation engines: a protocol, and the HF transformers engine (CPU and GPU).

An engine samples N answers per prompt and returns, per answer, the token ids, the behaviour
log-prob of every sampled token under the distribution it was drawn from (temperature and top-p
applied) and the finish reason. Weights reach it through its ``receiver``
(``reval.weights.receiver.WeightReceiver``): files and broadcasts, loaded in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor, nn

from buffer.records import FinishReason
from reval import lora
from reval.weights.receiver import LocalReceiver, WeightReceiver


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Answers per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16


@dataclass
class Sample:
    token_ids: np.ndarray
    """[T] int32; ends with a stop token (the engine's ``stop_ids``) when ``finish_reason ==
    "stop"``, and holds none before it."""
    logprobs: np.ndarray
    """[T] float32 behaviour log-probs."""
    finish_reason: FinishReason


class GenerationEngine(Protocol):
    """What ``reval train``, evaluation and every engine offer: ``generate`` a batch. The
    rollout worker drives a ``StreamEngine`` (an engine that is not one, the HF engine, is put
    behind ``LockstepStream``: ``as_stream``)."""

    policy_version: int
    receiver: WeightReceiver
    """Where the worker's ``WeightSubscriber`` delivers weights (files, broadcasts)."""
    stop_ids: tuple[int, ...]
    """The tokens that end an answer (``reval.answers.stop_token_ids``): what graders cut the
    answer's text at (``reval.answers.answer_text``)."""
    device: torch.device
    """Where it generates (the worker registers it)."""

    def close(self) -> None:
        """Release what it holds (an engine's processes, a temporary checkpoint); the worker
        calls it once, at its end."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[list[Sample]]:
        """For each prompt (token ids), ``params.n`` samples."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy tensors held by the caller in place and set the policy version (evaluation,
        tests). The tensors may be views of buffers the caller reuses afterwards: copy, do not
        keep them."""
        ...


InflightMode = Literal["keep", "recompute", "finish"]
"""What a weight load does to the answers in the engine (``rollout.inflight_updates``)."""


@dataclass
class Finished:
    """One request (one prompt's ``n`` answers) the engine has finished."""

    key: str
    samples: list[Sample]
    spans: list[np.ndarray]
    """Per answer, ``[start, version, ...]``: the weight version that sampled tokens from
    ``start`` on (``Trajectory.version_spans``; always at least one span here)."""


@runtime_checkable
class StreamEngine(GenerationEngine, Protocol):
    """What ``rollout.streaming.Streamer`` (the worker's one loop) needs of an engine besides
    ``GenerationEngine``: ``VLLMEngine``'s streaming methods, or ``LockstepStream``'s."""

    inflight: InflightMode

    def submit(self, key: str, prompt: Sequence[int], params: SamplingParams, seed: int) -> None:
        """Start ``params.n`` answers to ``prompt``, reported together as ``key``."""
        ...

    def step(self) -> list[Finished]:
        """Run one engine step; the requests it finished."""
        ...

    def running(self) -> int:
        """Answers submitted and not finished (0: the engine is empty)."""
        ...

    def pause(self) -> None:
        """Freeze the running answers between two steps."""
        ...

    def resume(self) -> None:
        """Go on with the frozen answers."""
        ...


class LockstepStream:
    """A ``GenerationEngine`` with the face of a ``StreamEngine`` (the HF engine's, so that one
    worker loop drives every engine): ``submit`` queues a request, ``step`` generates every
    request queued since the last step in one ``generate`` call (one batch: how a batched
    engine samples fastest) and finishes them all. Nothing is ever running between two steps,
    so weights always load with the engine empty: ``inflight`` has nothing to do."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.inflight: InflightMode = "finish"
        self._queued: list[tuple[str, list[int], SamplingParams, int]] = []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.engine.policy_version = version

    @property
    def receiver(self) -> WeightReceiver:
        return self.engine.receiver

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.engine.stop_ids

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def close(self) -> None:
        self.engine.close()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[list[Sample]]:
        return self.engine.generate(prompts, params, seed)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.engine.load_weights(named_tensors, version)

    def submit(self, key: str, prompt: Sequence[int], params: SamplingParams, seed: int) -> None:
        self._queued.append((key, list(prompt), params, seed))

    def step(self) -> list[Finished]:
        """Every queued request, one ``generate`` call per sampling setting (``n``,
        temperature, top-p; seeded by its first request's seed) at the largest
        ``max_new_tokens`` asked, each answer then cut to its own request's (finish ``length``
        when that cuts it: the first tokens of a longer sample are a sample of the shorter
        request), under the weights held now."""
        batches: dict[tuple[int, float, float], list[tuple[str, list[int], SamplingParams, int]]]
        batches = {}
        for request in self._queued:
            p = request[2]
            batches.setdefault((p.n, p.temperature, p.top_p), []).append(request)
        self._queued = []
        done = []
        for requests in batches.values():
            longest = max(requests, key=lambda r: r[2].max_new_tokens)[2]
            version = self.engine.policy_version
            out = self.engine.generate([r[1] for r in requests], longest, requests[0][3])
            span = np.array([0, version], dtype=np.int32)
            for r, samples in zip(requests, out, strict=True):
                samples = [_cut(s, r[2].max_new_tokens) for s in samples]
                done.append(Finished(r[0], samples, [span.copy() for _ in samples]))
        return done

    def running(self) -> int:
        return sum(r[2].n for r in self._queued)

    def pause(self) -> None:
        """Nothing runs between two steps."""

    def resume(self) -> None:
        """Nothing runs between two steps."""


def _cut(sample: Sample, max_tokens: int) -> Sample:
    """``sample`` cut to ``max_tokens`` tokens (finish ``length`` when that cuts it)."""
    if sample.token_ids.size <= max_tokens:
        return sample
    return Sample(sample.token_ids[:max_tokens], sample.logprobs[:max_tokens], "length")


def as_stream(engine: GenerationEngine) -> StreamEngine:
    """``engine`` itself when it streams (vLLM), else behind a ``LockstepStream``."""
    return engine if isinstance(engine, StreamEngine) else LockstepStream(engine)


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Set to -inf every token outside the smallest set whose probability reaches ``top_p``
    (the most likely token always stays)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p  # mass before this token already >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_tokens(probs: Tensor, uniform: Tensor) -> Tensor:
    """One token of each row of ``probs`` [B, V] (rows need not sum to 1) at its uniform draw
    ``uniform`` [B, 1] in [0, 1) -> [B, 1]: the inverse of the row's cumulative sum.
    ``torch.multinomial`` draws V exponentials a row (a fifth of the HF engine's generation time
    at the demo's 512 x 99); a token of probability 0 (``top_p``'s cut) is never drawn."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:].contiguous()  # (searchsorted warns of a strided one)
    choice = torch.searchsorted(cdf, uniform.to(cdf.dtype) * total, right=True)
    # a draw rounded up to the total would pick past the end: the last token of probability > 0
    return torch.minimum(choice, torch.searchsorted(cdf, total))


COMPACT_AT = 0.25
"""The HF engine drops finished answers from its batch (their cache rows too) once this share of
the batch has finished: the demo's answers end after 2 or 3 of their 4 tokens, and decoding them
on cost a third of its generation. Each answer's uniform draws are its own whatever the batch
(drawn for every answer at each step), so dropping changes no answer. 1.0: never drop."""


class HFEngine:
    """Batched sampling with a KV cache over any HF causal LM. An answer ends on ``eos_id`` or
    any of ``stop_ids`` (``Policy.stop_ids``: the stop set vLLM gets too), kept as its last
    token."""

    def __init__(
        self,
        model: nn.Module,
        pad_id: int,
        eos_id: int,
        device: torch.device | str = "cpu",
        max_batch: int = 1024,
        stop_ids: Iterable[int] = (),
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys([int(eos_id), *map(int, stop_ids)]))
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.policy_version = 0
        self.receiver = LocalReceiver(self.load_weights, self.device)
        """Files and broadcasts, received in this process and loaded in place."""

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        # state_dict names include tied aliases (lm_head.weight of a tied embedding), which
        # a full state dict from the learner carries too.
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        params.update(self.model.state_dict(keep_vars=True))
        if lora.is_lora(self.model):  # (a LoRA base file has the base's names: the aliases)
            params.update({lora.base_name(n): t for n, t in list(params.items())})
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"load_weights: the model has no tensor named {name!r}")
            dst = params[name]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor.to(dst.device, dst.dtype))
        self.policy_version = version

    def close(self) -> None:
        """Nothing to release: the model is the caller's."""

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, seed: int
    ) -> list[list[Sample]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        flat = [list(p) for p in prompts for _ in range(params.n)]
        samples: list[Sample] = []
        for start in range(0, len(flat), self.max_batch):
            samples.extend(self._generate_batch(flat[start : start + self.max_batch], params, gen))
        return [samples[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(
        self, rows: list[list[int]], params: SamplingParams, gen: torch.Generator
    ) -> list[Sample]:
        was_training = self.model.training
        self.model.eval()
        try:
            return self._sample(rows, params, gen)
        finally:
            self.model.train(was_training)

    def _prefill(self, rows: list[list[int]]) -> tuple[object, Tensor, Tensor, Tensor]:
        """The prompts' forward: each distinct prompt once (a round asks ``n`` answers of each)
        and its cache copied to its rows where the model's cache is a ``DynamicCache``
        (``reorder_cache``: every layer's state, a linear-attention layer's conv and recurrent
        states too; ``batch_select_indices`` has no such layer); every row where it is not (a
        model with its own cache: the distinct forward is then wasted).
        -> (cache, last logits [B, V], attention mask [B, W], positions [B, W])."""
        from transformers.cache_utils import DynamicCache

        first: dict[tuple[int, ...], int] = {}
        of_row = [first.setdefault(tuple(r), len(first)) for r in rows]
        if len(first) < len(rows):
            cache, logits, attn, pos = self._forward_prompts([list(r) for r in first])
            if isinstance(cache, DynamicCache):
                index = torch.tensor(of_row, dtype=torch.long, device=self.device)
                cache.reorder_cache(index)
                return cache, logits[index], attn[index], pos[index]
        return self._forward_prompts(rows)

    def _forward_prompts(self, rows: list[list[int]]) -> tuple[object, Tensor, Tensor, Tensor]:
        """``rows`` left-padded to the longest, through the model: (cache, last logits,
        attention mask, positions)."""
        bsz, width = len(rows), max(len(r) for r in rows)
        ids = torch.full((bsz, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((bsz, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            attn[i, width - len(r) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        return out.past_key_values, out.logits[:, -1, :], attn, pos

    def _sample(
        self, rows: list[list[int]], params: SamplingParams, gen: torch.Generator
    ) -> list[Sample]:
        from transformers.cache_utils import DynamicCache

        bsz = len(rows)
        cache, logits, attn, pos = self._prefill(rows)
        next_pos = pos[:, -1:] + 1
        tokens = torch.full((bsz, params.max_new_tokens), self.pad_id, dtype=torch.long)
        logps = torch.zeros((bsz, params.max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(bsz, dtype=torch.long)
        stopped = torch.zeros(bsz, dtype=torch.bool)
        at = torch.arange(bsz)  # the answer of each row of the batch being decoded
        done = torch.zeros(bsz, dtype=torch.bool, device=self.device)  # of those rows
        stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)
        for step in range(params.max_new_tokens):
            uniform = torch.rand((bsz, 1), generator=gen, device=gen.device)
            scaled = top_p_filter(logits.float() / params.temperature, params.top_p)
            logp_all = scaled.log_softmax(-1)
            draws = uniform[at.to(uniform.device)].to(self.device)  # the rows' own answers'
            choice = sample_tokens(logp_all.exp(), draws)  # [rows, 1]
            chosen_logp = logp_all.gather(-1, choice)[:, 0]
            choice = choice[:, 0]
            live = ~done
            tokens[at, step] = torch.where(live, choice, self.pad_id).cpu()
            logps[at, step] = torch.where(live, chosen_logp, 0.0).cpu()
            lengths[at] += live.long().cpu()
            done = done | torch.isin(choice, stops)
            stopped[at] = done.cpu()
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            if isinstance(cache, DynamicCache) and int(done.sum()) >= COMPACT_AT * done.numel():
                keep = (~done).nonzero()[:, 0]  # the rows still decoding, their cache with them
                cache.reorder_cache(keep)
                attn, next_pos, choice = attn[keep], next_pos[keep], choice[keep]
                at, done = at[keep.cpu()], done[keep]
            attn = torch.cat(
                [attn, torch.ones((attn.shape[0], 1), dtype=attn.dtype, device=self.device)], 1
            )
            out = self.model(
                input_ids=choice[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        # (as numpy and lists first: indexing a tensor row by row costs more than the answers)
        token_rows = tokens.numpy().astype(np.int32)
        logp_rows = logps.numpy()
        ends = zip(lengths.tolist(), stopped.tolist(), strict=True)
        return [
            Sample(
                token_ids=token_rows[i, :n].copy(),
                logprobs=logp_rows[i, :n].copy(),
                finish_reason="stop" if stopped else "length",
            )
            for i, (n, stopped) in enumerate(ends)
        ]
