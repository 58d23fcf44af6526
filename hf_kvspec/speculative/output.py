"""What a speculative ``generate`` call hands back: the streamer's tokens as rows complete them, the per-step
scores and logits ``generate`` returns, and the output object.

Boundary: turns the committed tokens of each round into ``generate``'s return value and streamer calls; no model
calls, no decisions. Rows are the call's rows (``B``); a round's active-row tensors arrive with the call-row index
of each active row (``rows.ActiveRows.call_rows``).

Shapes: ``B`` rows of the call, ``A`` active rows, ``T`` tokens emitted per row this round, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from hf_kvspec.speculative.positions import History
from hf_kvspec.speculative.stats import AcceptanceStats


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the call's ``AcceptanceStats``."""

    acceptance: AcceptanceStats | None = None


class CallOutput:
    """Scores / logits per emitted token (when ``generate`` was asked for them) and the streamer of one call."""

    def __init__(self, generation_config, streamer, batch: int, prompt_len: int):
        self.config = generation_config
        wants = bool(generation_config.return_dict_in_generate)
        self.score_rows = [[] for _ in range(batch)] if wants and generation_config.output_scores else None
        self.logit_rows = [[] for _ in range(batch)] if wants and generation_config.output_logits else None
        self.streamer = streamer
        self.streamed = prompt_len  # history columns handed to the streamer

    def record(self, call_rows: list[int], scores: torch.Tensor, logits: torch.Tensor, positions: torch.Tensor,
               keep: torch.Tensor) -> None:
        """Keep the first ``keep`` [A] emitted tokens' scores/logits ([A, T', V]; ``positions`` [A, T] says which
        row of them produced emitted token j) for the call rows ``call_rows``."""
        for store, values in ((self.score_rows, scores), (self.logit_rows, logits)):
            if store is None:
                continue
            picked = values.gather(1, positions[..., None].expand(-1, -1, values.shape[-1]))  # [A, T, V]
            for active, (row, count) in enumerate(zip(call_rows, keep.tolist())):
                store[row].append(picked[active, :count].float())

    def stream(self, history: History, alive: torch.Tensor, final: bool = False) -> None:
        """Hand the streamer every column that all ``alive`` [B] rows have completed (only final tokens)."""
        if self.streamer is None:
            return
        lengths = torch.where(alive, history.lengths, history.lengths.max())
        ready = int(history.lengths.max() if final else lengths.min())
        if ready > self.streamed:
            ids = history.ids[:, self.streamed:ready]
            if ids.shape[0] == 1:
                self.streamer.put(ids[0].cpu())
            else:
                for col in range(ids.shape[1]):
                    self.streamer.put(ids[:, col].cpu())
            self.streamed = ready
        if final:
            self.streamer.end()

    def result(self, history: History, cache, stats: AcceptanceStats):
        """``generate``'s return value: the sequences, or the output object with scores, logits, cache, stats."""
        sequences = history.sequences()
        if not self.config.return_dict_in_generate:
            return sequences
        steps = sequences.shape[1] - history.prompt_len
        return SpeculativeGenerateOutput(sequences=sequences, scores=_per_step(self.score_rows, steps),
                                         logits=_per_step(self.logit_rows, steps), cache=cache, acceptance=stats)


def _per_step(rows: list[list[torch.Tensor]] | None, steps: int):
    """Per-row score lists -> generate's tuple of ``steps`` tensors [B, V] (zeros after a row stopped)."""
    if rows is None:
        return None
    stacked = [torch.cat(chunks) for chunks in rows]  # each [T_row, V]
    vocab = stacked[0].shape[-1]
    out = torch.zeros(len(rows), steps, vocab, dtype=stacked[0].dtype, device=stacked[0].device)
    for row, values in enumerate(stacked):
        out[row, : values.shape[0]] = values
    return tuple(out.unbind(1))
