"""Core pieces of `specdec train` that need no training run: data items, splits, batches,
the learning-rate schedule, prompts of models with and without a chat template."""

import pytest

from specdec import LLM, testing
from specdec.training.data import TrainingDataError, encode_prompt, read_items, split_eval
from specdec.training.loop import lr_factor, make_batches


def test_read_items_checks_each_line(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{"text": "c"}\n')
    assert len(read_items(good)) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(TrainingDataError, match="bad.jsonl:2: expected"):
        read_items(bad)


def test_held_out_prompts_are_the_last_and_at_most_a_quarter():
    items = [{"prompt": str(i)} for i in range(10)] + [{"text": "t"}]
    train, held = split_eval(items, 16)
    assert [h["prompt"] for h in held] == ["8", "9"] and len(train) == 9


def test_batches_are_fixed_by_seed_and_epoch_and_cover_every_sample():
    a, b = make_batches(list(range(10)), 3, seed=0, epoch=0), make_batches(list(range(10)), 3, seed=0, epoch=0)
    assert a == b and sorted(i for batch in a for i in batch) == list(range(10))
    assert make_batches(list(range(10)), 3, seed=0, epoch=1) != a


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1) and lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(100, 10, 100) == pytest.approx(0.1) and lr_factor(55, 10, 100) < 1.0


def test_prompts_use_the_chat_template_only_where_there_is_one(smol, tmp_path):
    item = {"prompt": "Hello there"}
    assert encode_prompt(smol, item) == smol.apply_chat_template([{"role": "user", "content": "Hello there"}])
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = testing.tiny_model_dir(tmp_path, vocab_size=32)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(directory)
    base = LLM(model=str(directory))
    assert encode_prompt(base, {"prompt": "w3 w4 w5"}) == [3, 4, 5]
