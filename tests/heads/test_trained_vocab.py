"""Training with an EAGLE-3 draft vocabulary: ids chosen by label frequency, own projection trained, buffers saved."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.trained_vocab import most_frequent_labels, projection_cost
from tests.heads.tiny_base import save_tiny_base, write_tiny_corpus

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_drafter.py"


def test_most_frequent_labels_counts_data_and_predictions():
    data = [{"input_ids": [3, 3, 5], "target_tokens": torch.tensor([5, 5, 7])}, {"input_ids": [7, 1]}]
    # counts: 5 -> 3, 3 -> 2, 7 -> 2, 1 -> 1; ties by ascending id, then unseen ids
    assert most_frequent_labels(data, 10, 6).tolist() == [5, 3, 7, 1, 0, 2]


def test_projection_cost_smollm2():
    cost = projection_cost(576, 49152, 8192)
    assert cost["full_flops_per_row"] == 2 * 576 * 49152 and cost["flops_per_row"] == 2 * 576 * 8192
    assert cost["saving"] == 6.0 and cost["weight_bytes"] == 8192 * 576 * 2


def test_train_drafter_with_draft_vocab(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    save_tiny_base(tmp_path / "base")
    write_tiny_corpus(tmp_path / "corpus.txt")
    train_drafter.main(["--head", "eagle", "--architecture", "eagle3", "--feature_layers", "1", "2",
                        "--draft_vocab_size", "20", "--base_model", str(tmp_path / "base"), "--dataset",
                        str(tmp_path / "corpus.txt"), "--label_source", "data", "--max_steps", "3",
                        "--per_device_batch_size", "4", "--learning_rate", "1e-2", "--warmup_steps", "1",
                        "--num_threads", "1", "--data_cache_dir", str(tmp_path / "cache"),
                        "--output_dir", str(tmp_path / "out")])
    head = EagleHead.from_pretrained(tmp_path / "out")
    assert head.config.draft_vocab_size == 20 and head.lm_head.weight.shape[0] == 20
    assert int(head.t2d.sum()) == 20 and torch.equal(head.draft_vocab_ids(), torch.nonzero(head.t2d).flatten())
    from tests.heads.tiny_base import char_tokenizer

    corpus_ids = set(char_tokenizer()((tmp_path / "corpus.txt").read_text())["input_ids"])
    assert len(corpus_ids) < 20 and corpus_ids <= set(head.draft_vocab_ids().tolist())  # every data token kept


def test_held_out_drafts_are_target_ids(tmp_path):
    # evaluation compares drafts with the target's tokens, so a draft-vocabulary head's ids must be mapped back
    from transformers import AutoModelForCausalLM

    from hf_kvspec.heads.evaluation import draft_tokens
    from hf_kvspec.heads.features import target_features

    base = AutoModelForCausalLM.from_pretrained(save_tiny_base(tmp_path / "base")).eval()
    head = EagleHead(EagleHead.config_class.for_base_model(base, feature_layers=[1, 2], architecture="eagle3",
                                                                 draft_vocab_size=6)).attach(base).eval()
    head.set_draft_vocab(torch.tensor([40, 41, 42, 43, 44, 45]))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        features, _ = target_features(base, ids, torch.ones_like(ids, dtype=torch.bool), head.config.feature_layers)
        drafts = draft_tokens(head, features, ids, depth=2)
    assert set(drafts.flatten().tolist()) <= {40, 41, 42, 43, 44, 45}


def test_head_vocabulary_follows_a_state_loaded_into_the_head():
    """Resuming loads lm_head and d2t into the head after the loss was built (``accelerator.load_state``): the label
    columns must be those of the loaded vocabulary, not of the one the head held first (which, when the training data
    changed between sessions, is another set of ids: the loss exploded to a fresh head's after such a resume)."""
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.trained_vocab import HeadVocabulary, init_draft_vocab
    from tests.tiny_models import tiny_model

    base = tiny_model("llama", seed=0)
    heads = []
    for seed, ids in ((0, torch.arange(20)), (1, torch.arange(40, 60))):
        torch.manual_seed(seed)
        head = EagleHead(EagleConfig.for_base_model(base, "tiny", feature_layers=[0, 1, 2], architecture="eagle3",
                                                    draft_vocab_size=20)).attach(base)
        init_draft_vocab(head, ids)
        heads.append(head)
    first, saved = heads
    vocab = HeadVocabulary(first)
    first.load_state_dict(saved.state_dict())
    labels = torch.tensor([[45, 40, 59, 3]])
    assert vocab.columns(labels).tolist() == [[5, 0, 19, -1]]  # 3 is no longer in the draft vocabulary
    hidden = torch.randn(2, base.config.hidden_size)
    assert torch.equal(vocab.logits(hidden, None), hidden @ saved.lm_head.weight.T)
    assert vocab.vocab_ids.tolist() == list(range(40, 60))
