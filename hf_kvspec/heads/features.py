"""Target features for head training: computed online from the frozen target, or pre-extracted to safetensors shards.

Boundary: token sequences in, per-position target features and the target's greedy next tokens out. Knows nothing
about the heads' architectures (only which hidden-state layers to keep).

Shapes: B batch, T positions, F = len(feature_layers) * H feature width, N tokens in a shard (sequences flattened).
``target_tokens[t]`` is the target's argmax after reading tokens 0..t, i.e. its greedy prediction of token t+1.

Shard layout (``features-00000.safetensors``): ``input_ids`` [N] int32, ``features`` [N, F] float16,
``target_tokens`` [N] int32, ``lengths`` [S] int64, ``prompt_lengths`` [S] int64; plus ``features.json`` with the
target fingerprint and ``feature_layers`` so a cache built for another target or layer set is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

SHARD_TOKENS = 1 << 16  # tokens per shard file


def right_padded(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, valid)`` [B, T_max]; right padding keeps every real token's causal prefix unchanged."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        valid[row, :len(seq)] = True
    return ids, valid


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, valid: torch.Tensor,
                    feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the frozen target once: ``features`` [B, T, F] (hidden states of ``feature_layers``, concatenated) and
    ``target_tokens`` [B, T] (argmax next token)."""
    out = target(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1)
    return features, out.logits.argmax(dim=-1)


class FeatureCacheMismatchError(RuntimeError):
    """A feature cache on disk was built for another target, layer set or data recipe."""


def _check_meta(directory: Path, meta: dict) -> bool:
    """True if a complete cache with the same metadata exists; raise if one exists with different metadata."""
    path = directory / "features.json"
    if not path.is_file():
        return False
    found = json.loads(path.read_text())
    if found != meta:
        raise FeatureCacheMismatchError(
            f"{directory} holds features for {found}, not {meta}. Delete it or choose another --feature_cache_dir."
        )
    return True


def _write_shard(directory: Path, index: int, rows: list[dict]) -> None:
    tensors = {
        "input_ids": torch.cat([r["input_ids"] for r in rows]).to(torch.int32),
        "features": torch.cat([r["features"] for r in rows]).to(torch.float16),
        "target_tokens": torch.cat([r["target_tokens"] for r in rows]).to(torch.int32),
        "lengths": torch.tensor([len(r["input_ids"]) for r in rows], dtype=torch.int64),
        "prompt_lengths": torch.tensor([r["prompt_length"] for r in rows], dtype=torch.int64),
    }
    save_file(tensors, str(directory / f"features-{index:05d}.safetensors"))


def extract_to_cache(target, examples: list[dict], directory: str | Path, feature_layers: list[int], meta: dict,
                     batch_size: int = 8, progress: bool = True) -> Path:
    """Pre-extract features for ``examples`` (dicts with ``input_ids`` list and ``prompt_length``) once."""
    directory = Path(directory)
    meta = {**meta, "feature_layers": list(feature_layers), "num_sequences": len(examples)}
    if _check_meta(directory, meta):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    device = next(target.parameters()).device
    rows, shard, pending = [], 0, 0
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["input_ids"]))  # little padding per batch
    for start in tqdm(range(0, len(order), batch_size), desc="extract features", disable=not progress):
        batch = [examples[i] for i in order[start:start + batch_size]]
        ids, valid = right_padded([ex["input_ids"] for ex in batch])
        features, tokens = target_features(target, ids.to(device), valid.to(device), feature_layers)
        for row, ex in enumerate(batch):
            n = len(ex["input_ids"])
            rows.append({"input_ids": ids[row, :n], "features": features[row, :n].cpu(),
                         "target_tokens": tokens[row, :n].cpu(), "prompt_length": ex["prompt_length"]})
            pending += n
        if pending >= SHARD_TOKENS:
            _write_shard(directory, shard, rows)
            rows, shard, pending = [], shard + 1, 0
    if rows:
        _write_shard(directory, shard, rows)
    (directory / "features.json").write_text(json.dumps(meta, indent=2))  # written last: marks the cache complete
    return directory


class CachedFeatures(torch.utils.data.Dataset):
    """Sequences from a feature cache; item = dict of ``input_ids`` [T], ``features`` [T, F], ``target_tokens`` [T],
    ``prompt_length``."""

    def __init__(self, directory: str | Path, expected_meta: dict | None = None):
        directory = Path(directory)
        if expected_meta is not None:
            meta = json.loads((directory / "features.json").read_text())
            mismatched = {k: (meta.get(k), v) for k, v in expected_meta.items() if meta.get(k) != v}
            if mismatched:
                raise FeatureCacheMismatchError(f"{directory}: cached (found, expected) differ: {mismatched}")
        self.items: list[dict] = []
        for shard in sorted(directory.glob("features-*.safetensors")):
            self._split_shard(load_file(str(shard)))

    def _split_shard(self, tensors: dict) -> None:
        offsets = torch.cumsum(tensors["lengths"], 0).tolist()
        for end, length, prompt_length in zip(offsets, tensors["lengths"].tolist(), tensors["prompt_lengths"].tolist()):
            span = slice(end - length, end)
            self.items.append({"input_ids": tensors["input_ids"][span].long(), "features": tensors["features"][span],
                               "target_tokens": tensors["target_tokens"][span].long(), "prompt_length": prompt_length})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def collate(items: list[dict]) -> dict:
    """Right-pad a list of sequences: ``input_ids``/``valid`` [B, T] (+ ``features`` [B, T, F], ``target_tokens``)."""
    ids, valid = right_padded([item["input_ids"].tolist() if torch.is_tensor(item["input_ids"]) else item["input_ids"]
                               for item in items])
    batch = {"input_ids": ids, "valid": valid,
             "prompt_length": torch.tensor([item["prompt_length"] for item in items])}
    if "features" in items[0]:
        width = items[0]["features"].shape[-1]
        features = torch.zeros((*ids.shape, width), dtype=items[0]["features"].dtype)
        tokens = torch.zeros_like(ids)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            features[row, :n], tokens[row, :n] = item["features"], item["target_tokens"]
        batch.update(features=features, target_tokens=tokens)
    return batch
