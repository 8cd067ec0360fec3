"""Turns a scheduled step into model inputs, runs the model, and samples.

The model is anything with the forward signature of `atom_models` causal LMs:
`(input_ids, positions, kv_caches, AttentionMetadata, logits_indices) -> fp32 logits`,
either the eager nn.Module or a compiled artifact. The runner owns the KV cache.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from transformers import PretrainedConfig

from atom_compile.load import CompiledModel
from atom_models.layers import AttentionMetadata
from atom_models.llama import head_dim_of
from atom_models.ops.attention import INLINE_SCALE_DTYPE, kv_cache_shape
from atom_models.ops.quant import FP8_DTYPE
from atom_runtime.config import EngineConfig
from atom_runtime.cuda_graphs import FullGraphs, GraphKey, PiecewiseGraphs
from atom_runtime.sampler import DeviceSample, Draws, Sampler, on_device, with_logprobs
from atom_runtime.sampling_params import SamplingParams
from atom_runtime.scheduler import PROMPT_LOGPROB_ROWS, ScheduledChunk
from atom_runtime.sequence import Sequence
from atom_runtime.step_inputs import StepInputs

logger = logging.getLogger(__name__)

ModelForward = Callable[[Tensor, Tensor, list[Tensor], AttentionMetadata, Tensor], Tensor]


@dataclass
class LoadedModel:
    """A runnable model and what the runtime needs to know about it."""

    forward: ModelForward
    config: PretrainedConfig
    dtype: torch.dtype
    device: torch.device
    model_dir: str  # where the tokenizer lives


class ModelRunner:
    def __init__(self, model: LoadedModel, config: EngineConfig, sampler: Sampler):
        self.model = model
        self.config = config
        self.sampler = sampler
        self.device = model.device
        hf = model.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf.num_key_value_heads
        self.head_dim = head_dim_of(hf)
        self.block_size = config.block_size
        self.kv_dtype = {
            "auto": model.dtype,
            "bf16": torch.bfloat16,
            "fp8": FP8_DTYPE,
            "fp8_per_token_head": INLINE_SCALE_DTYPE,
        }[config.kv_cache_dtype]
        self.max_model_len = config.max_model_len
        cuda = self.device.type == "cuda"
        self.capture_sizes = config.graph_capture_sizes() if cuda else []
        self.mixed_sizes = config.mixed_graph_sizes() if cuda else []
        self.piecewise_sizes = config.piecewise_capture_sizes() if cuda else []
        if self.piecewise_sizes and not isinstance(model.forward, CompiledModel):
            logger.info("piecewise CUDA graphs need a compiled artifact; prefill and mixed steps run eagerly")
            self.piecewise_sizes = []
        self.any_graphs = bool(self.capture_sizes or self.mixed_sizes or self.piecewise_sizes)
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = [self.empty_kv_cache(self.num_blocks) for _ in range(self.num_layers)]
        kind = "e4m3, a scale per token and head" if self.kv_dtype == INLINE_SCALE_DTYPE else self.kv_dtype
        logger.info("KV cache: %d blocks of %d tokens (%s)", self.num_blocks, self.block_size, kind)
        self.inputs = StepInputs(
            max(config.max_num_batched_tokens, max(self.capture_sizes, default=0)),
            config.max_num_seqs,
            -(-self.max_model_len // self.block_size),
            self.block_size,
            self.device,
        )
        self._turn = 0
        self._sampled_host = (
            [(torch.empty(config.max_num_seqs, dtype=torch.int64, pin_memory=True), torch.cuda.Event()) for _ in "ab"]
            if self.device.type == "cuda"
            else []
        )
        self.graphs: FullGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if self.any_graphs:
            pool = torch.cuda.graph_pool_handle()  # one pool for all graphs (see atom_runtime.cuda_graphs)
            if self.capture_sizes or self.mixed_sizes:
                self.graphs = FullGraphs(self, self.capture_sizes, pool, self.mixed_sizes)
                self.graphs.capture()
            if self.piecewise_sizes:
                self.piecewise = PiecewiseGraphs(model.forward, self.piecewise_sizes, pool)
                if self.piecewise.num_graphed:
                    self.piecewise.capture(self)
                else:  # nothing compiled (an artifact exported at level 0)
                    self.piecewise.release()
                    self.piecewise = None

    def release(self) -> None:
        """Give back the device memory of the KV cache and the graphs, so another engine fits in this process."""
        if not self.kv_caches:
            return
        self.graphs = None
        if self.piecewise is not None:
            self.piecewise.release()
            self.piecewise = None
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return kv_cache_shape(self.kv_dtype, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def empty_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(self.kv_cache_shape(num_blocks), dtype=self.kv_dtype, device=self.device)

    @property
    def block_bytes(self) -> int:
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return math.prod(self.kv_cache_shape(1)) * element * self.num_layers

    def _decide_num_blocks(self) -> int:
        if self.config.num_kvcache_blocks:
            return self.config.num_kvcache_blocks
        if self.device.type == "cpu":
            wanted = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
            space = int(self.config.cpu_kvcache_space_gib * 2**30) // self.block_bytes
            return max(1, min(wanted, space))
        return self._blocks_that_fit_on_gpu()

    def _blocks_that_fit_on_gpu(self) -> int:
        """Blocks that fit in gpu_memory_utilization of the card after weights and a peak-sized step."""
        torch.cuda.synchronize()
        # Garbage the process left in reference cycles still holds device memory, which the budget would count as
        # used (before an export collected its own, it left a Llama-3-8B's 13 GiB of weights so).
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.profile_run()
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - before
        torch.cuda.empty_cache()
        graph_bytes = self._graph_memory() if self.any_graphs else 0
        free, total = torch.cuda.mem_get_info()
        available = total * self.config.gpu_memory_utilization - (total - free) - activation_peak - graph_bytes
        num_blocks = int(available // self.block_bytes)
        if num_blocks < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: {available / 2**30:.2f} GiB available at "
                f"gpu_memory_utilization={self.config.gpu_memory_utilization}; "
                "raise it or lower max_num_batched_tokens"
            )
        return num_blocks

    def _graph_memory(self) -> int:
        """Memory the graphs will hold: the largest of each kind captured over a one-block cache, with margin (their
        outputs share the pool, `unowned`)."""
        size = max(self.capture_sizes + self.mixed_sizes + self.piecewise_sizes)
        cache = self.empty_kv_cache(1)
        self.kv_caches = [cache] * self.num_layers
        self.inputs = StepInputs(size, self.config.max_num_seqs, 1, self.block_size, self.device)
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        trials: list[FullGraphs | PiecewiseGraphs] = []
        full_keys: list[GraphKey] = []  # every whole-step graph but the short batch-1 one (the table here is narrow)
        if self.capture_sizes or self.mixed_sizes:
            full_keys = FullGraphs(self, self.capture_sizes, pool, self.mixed_sizes).capture_keys()
            trial = FullGraphs(self, self.capture_sizes[-1:], pool, self.mixed_sizes[-1:])
            decode, mixed = ([k for k in trial.capture_keys() if (k.tokens is None) == d][:1] for d in (True, False))
            trial.capture(decode + mixed, progress=False)  # the largest of each kind
            trials.append(trial)
        if self.piecewise_sizes:
            trial = PiecewiseGraphs(self.model.forward, [max(self.piecewise_sizes)], pool)
            if trial.num_graphed:
                trial.capture(self, progress=False)
                trials.append(trial)
            trial.release()
        used = free_before - torch.cuda.mem_get_info()[0]
        del trials, self.kv_caches, self.inputs, cache
        torch.cuda.empty_cache()
        max_blocks = -(-self.max_model_len // self.block_size)
        short = FullGraphs.short_graph_blocks(self.capture_sizes, max_blocks, self.block_size) is not None
        graphs = len(full_keys) + len(self.piecewise_sizes) + int(short)
        return int(used * 1.2) + (2 << 20) * graphs

    def profile_run(self) -> None:
        """One step of max_num_batched_tokens prompt tokens, to measure peak activation memory; with as many logits
        rows as a step may return (a sampled token a sequence and PROMPT_LOGPROB_ROWS scored prompt positions: fp32,
        a vocabulary wide: 0.6 GB for 1024 rows of a 152 k vocabulary) and their scoring's log-softmax."""
        tokens = self.config.max_num_batched_tokens
        seq_len = min(tokens, self.max_model_len)
        num_seqs = -(-tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        cache = self.empty_kv_cache(num_seqs * blocks_per_seq)
        lens = [seq_len] * (num_seqs - 1) + [tokens - seq_len * (num_seqs - 1)]
        positions = np.concatenate([np.arange(n) for n in lens])
        tables = np.arange(num_seqs * blocks_per_seq).reshape(num_seqs, blocks_per_seq)
        slots = np.concatenate(
            [
                tables[i, np.arange(n) // self.block_size] * self.block_size + np.arange(n) % self.block_size
                for i, n in enumerate(lens)
            ]
        )
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            seq_lens=self._tensor(lens, torch.int32),
            query_start_loc=self._tensor(np.concatenate([[0], np.cumsum(lens)]), torch.int32),
        )
        rows = min(tokens, self.config.max_num_seqs + PROMPT_LOGPROB_ROWS)
        scored = min(rows, PROMPT_LOGPROB_ROWS)
        with torch.inference_mode():
            logits = self.model.forward(
                self._tensor(np.zeros(tokens), torch.int64),
                self._tensor(positions, torch.int64),
                [cache] * self.num_layers,
                meta,
                self._tensor(np.arange(rows) * tokens // rows, torch.int64),
            )
            targets = torch.zeros(scored, dtype=torch.long, device=self.device)
            with_logprobs(logits[-scored:], targets, self.config.max_logprobs)
            self._profile_sampler(logits[: min(rows, self.config.max_num_seqs)])
        del cache, logits

    def _profile_sampler(self, logits: Tensor) -> None:
        """The sampler's costliest path over a step's sampled rows, for its temporaries (copies of the logits,
        penalty counts, top-p's sort: several times the logits): penalties, a logit bias, top-k, top-p, min-p and
        logprobs on every row."""
        rows = logits.shape[0]
        params = SamplingParams(
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.1,
            logit_bias={0: 1.0},
            logprobs=self.config.max_logprobs,
        )
        seqs = [Sequence(str(row), 0, [0], params) for row in range(rows)]
        zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.sampler(logits, seqs, Draws(torch.ones(rows, device=self.device), zeros, zeros.int()))

    def _tensor(self, values, dtype: torch.dtype) -> Tensor:
        return torch.as_tensor(np.asarray(values), dtype=dtype).to(self.device)

    @torch.inference_mode()
    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], in_flight: DeviceSample | None = None) -> DeviceSample | None:
        """Queue one step on the device and return its samples without waiting for them.

        `in_flight` is the previous step's samples, still on the device: sequences whose last
        token is a placeholder take it from there.
        """
        previous = in_flight.token_ids if in_flight is not None else None
        graph_key = self.graphs.key_for(chunks) if self.graphs is not None else None
        drawn = None
        if graph_key is not None:
            self.graphs.load(graph_key, chunks, in_flight=previous)
            logits, drawn = self.graphs.replay(graph_key)
        elif self.piecewise is not None:
            tokens = self.piecewise.size_for(sum(c.num_tokens for c in chunks))
            sizes = self.inputs.load(chunks, in_flight=previous, pad_tokens_to=tokens)
            with self.piecewise.running(tokens):
                logits = self.model.forward(*self._step_args(*sizes))
        else:
            sizes = self.inputs.load(chunks, in_flight=previous)
            logits = self.model.forward(*self._step_args(*sizes))
        sampling = [c.seq for c in chunks if c.samples]
        n = len(sampling)
        # Rows past the sampled ones: a graph's padding, or else prompt positions scored for prompt_logprobs.
        scores = graph_key is None and logits.shape[0] > n
        prompt = self._score_prompts(chunks, logits[n:]) if scores else None
        if not sampling and prompt is None:
            return None
        if sampling:
            sample = self.sampler(logits[:n], sampling, self.inputs.draws(n), drawn[:n] if drawn is not None else None)
        else:
            sample = DeviceSample(torch.empty(0, dtype=torch.long, device=logits.device))
        sample.prompt = prompt
        # Two steps can be in flight on the host side (one queued, one being read): alternate buffers.
        self._turn ^= 1
        if self._sampled_host:
            sample.start_copy(*self._sampled_host[self._turn])
        else:
            sample.start_copy()
        return sample

    @staticmethod
    def _score_prompts(chunks: list[ScheduledChunk], logits: Tensor) -> DeviceSample:
        """prompt_logprobs: each row scores the token after its prompt position (`ScheduledChunk.scored`)."""
        scored = [c for c in chunks if c.scored]
        targets = [t for c in scored for t in c.seq.token_ids[c.scored.start + 1 : c.scored.stop + 1]]
        k = max(c.seq.params.prompt_logprobs for c in scored)
        return with_logprobs(logits[: len(targets)], on_device(targets, torch.long, logits.device), k)

    def _step_args(self, tokens: int, seqs: int, logits: int, table_blocks: int | None = None) -> tuple:
        input_ids, positions, meta, logits_indices = self.inputs.views(tokens, seqs, logits, table_blocks)
        return input_ids, positions, self.kv_caches, meta, logits_indices
