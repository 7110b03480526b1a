"""Runs one model over a scheduled step: flatten the sequences into one batch (token ids,
positions, slot mapping, block tables, context lengths), one forward pass, then sample."""
from __future__ import annotations

from typing import Callable

import torch

from engine.config import ModelConfig
from engine.model import CausalLM, StepBatch
from engine.sampler import probs as sampling_probs
from engine.sampler import sample, verify
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, isolated


def _padded(rows: list[list[int]]) -> torch.Tensor:
    """Block tables padded with each row's own first block: attention reads (and masks)
    padding too, and a block of another sequence may hold its NaNs (0 * NaN is NaN)."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + r[:1] * (width - len(r)) for r in rows], dtype=torch.long)


class ModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, num_blocks: int, block_size: int, kv_int8: bool = False,
                 bans: Callable[[Sequence, int], list[int]] | None = None):
        """bans(seq, i): token ids the model may not write at index i of seq (StopChecker.bans)."""
        self.model, self.cfg, self.block_size, self.bans = model, cfg, block_size, bans
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = torch.int8 if kv_int8 else torch.float32
        self.kv_caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype),
                           *((torch.ones(shape[:-1]), torch.ones(shape[:-1])) if kv_int8 else (None, None)))
                          for _ in range(cfg.num_layers)]

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_int8: bool = False) -> int:
        per_head = cfg.head_dim + 4 if kv_int8 else cfg.head_dim * 4     # int8 values + one fp32 scale
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_head

    def clear(self, block_ids: list[int]) -> None:
        """Zero blocks whose KV may be non-finite: attention reads a block's stale slots too,
        masked, and 0 * NaN is NaN."""
        for t in (t for layer in self.kv_caches for t in layer if t is not None):
            t[block_ids] = 0

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, StepBatch,
                                                              list[tuple[ScheduledSeq, int]]]:
        """Flatten the step: single-token decodes first (one batched attention call), then
        chunks (prefills and speculative verifications). Returns each item with its first row."""
        decodes = [s for s in scheduled if s.is_decode]
        chunks = [s for s in scheduled if not s.is_decode]
        bs = self.block_size
        ids, positions, slots, rows = [], [], [], []
        for item in decodes + chunks:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            rows.append((item, len(ids)))
            ids.extend(seq.tokens(start, end))
            positions.append(pos := torch.arange(start, end))
            slots.append(torch.tensor(seq.block_table)[pos // bs] * bs + pos % bs)
        batch = StepBatch(torch.cat(slots), len(decodes), self.kv_caches)
        if decodes:
            batch.decode_block_tables = _padded([s.seq.block_table for s in decodes])
            batch.decode_context_lens = torch.tensor([len(s.seq) for s in decodes])
        if chunks:
            batch.prefill_block_tables = _padded([s.seq.block_table for s in chunks])
            batch.prefill_context_lens = torch.tensor([s.seq.num_computed_tokens + s.num_tokens for s in chunks])
            batch.prefill_query_start = torch.tensor([0] + [s.num_tokens for s in chunks]).cumsum(0)
        return torch.tensor(ids), torch.cat(positions), batch, rows

    @torch.inference_mode()
    def all_logprobs(self, item: ScheduledSeq) -> torch.Tensor:
        """Log-probabilities over the vocabulary at every position of one chunk (scoring)."""
        input_ids, positions, batch, _ = self.prepare([item])
        return torch.log_softmax(self.model.logits(self.model(input_ids, positions, batch)), dim=-1)

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSeq], return_probs: bool = False):
        """seq_id -> (new tokens, their log-probabilities under the model's own distribution)
        for every item that reaches its sequence's end: one token, or for a verification the
        accepted drafts plus one. With return_probs, also seq_id -> the distribution a token was
        sampled from (for the rejection rule). A sequence whose share fails (non-finite logits,
        a sampling error) gets its `error` set and no entry."""
        input_ids, positions, batch, rows = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, batch)
        # Each sampling item's last row, or a verification's k + 1: one LM-head pass over all
        # of them, as the head is the largest matrix.
        sampling = [(item, row + item.num_tokens - 1 - item.num_draft, 1 + item.num_draft)
                    for item, row in rows if item.samples]
        out: dict[int, tuple[list[int], list[float]]] = {}
        probs: dict[int, torch.Tensor] = {}
        needed = [row + j for _, row, n in sampling for j in range(n)]
        all_logits = self.model.logits(hidden[needed]) if needed else hidden[:0]
        finite = torch.isfinite(all_logits).all(-1).tolist()
        at = 0
        for item, _, n in sampling:
            seq, logits, rows_finite, at = item.seq, all_logits[at:at + n], finite[at:at + n], at + n
            with isolated(seq):
                if not all(rows_finite):
                    raise FloatingPointError("the model's logits for this request are not finite")
                for j in range(n if self.bans and seq.thinking else 0):     # row j predicts index len + j
                    logits[j, self.bans(seq, len(seq) + j)] = float("-inf")
                if item.num_draft:
                    tokens = verify(logits, seq.draft[:item.num_draft], seq.draft_probs, seq.params, seq.generator)
                else:
                    tokens = [sample(logits[0], seq.params, seq.generator)]
                    if return_probs and not seq.params.greedy:
                        probs[seq.seq_id] = sampling_probs(logits[0], seq.params)[None]
                lp = torch.log_softmax(logits[:len(tokens)], -1).gather(1, torch.tensor(tokens)[:, None])
                out[seq.seq_id] = (tokens, lp.squeeze(1).tolist())
        return (out, probs) if return_probs else out
