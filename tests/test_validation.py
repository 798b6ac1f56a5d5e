"""Bad input gets a clear ValueError before any model work, and nothing is left half-done."""

import pytest
from conftest import make_tokenizer, words
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specviz.core.generator import MAX_GAMMA, MAX_NEW_TOKENS, Settings, generate
from specviz.models.loading import check_same_tokenizer, get_preset, load_pair, resolve_model_path
from specviz.tools import cli

BAD_SETTINGS = [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=MAX_NEW_TOKENS + 1), "max_new_tokens"),
    (dict(gamma=0), "gamma"),
    (dict(gamma=MAX_GAMMA + 1), "gamma"),
    (dict(gamma=2.5), "gamma"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(drafter="oracle"), "drafter"),
    (dict(gamma_policy="sometimes"), "gamma_policy"),
    (dict(gamma=8, gamma_max=4), "gamma_max"),
]


@pytest.mark.parametrize("kwargs, field", BAD_SETTINGS, ids=[str(k) for k, _ in BAD_SETTINGS])
def test_bad_settings_raise_before_generation(random_pair, kwargs, field):
    with pytest.raises(ValueError, match=field):
        Settings(**kwargs).validate()
    with pytest.raises(ValueError, match=field):
        generate(random_pair, "hello", Settings(**kwargs), prompt_ids=words(1))


@pytest.mark.parametrize("prompt", ["", "   \n\t"])
def test_empty_prompt(random_pair, prompt):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(random_pair, prompt, Settings())


def test_unknown_preset_and_model():
    with pytest.raises(ValueError, match="unknown preset 'nope'.*offline"):
        get_preset("nope")
    with pytest.raises(ValueError, match="unknown preset"):
        load_pair(preset="nope")
    with pytest.raises(ValueError, match="unknown offline model"):
        resolve_model_path("offline:nothing")
    with pytest.raises(ValueError, match="either a preset or"):
        load_pair("a", "b", preset="offline")


def test_missing_local_model_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="could not load model"):
        load_pair(str(tmp_path / "missing-target"), str(tmp_path / "missing-draft"), device="cpu", dtype="float32")


def test_mismatched_tokenizers_name_both_models_and_the_token(tmp_path, pattern_dirs):
    ours = make_tokenizer(tmp_path / "ours")
    vocab = dict(ours.get_vocab())
    vocab["w7x"] = vocab.pop("w7")
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    theirs = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    with pytest.raises(ValueError, match=r"'draft-x'.*'target-y'.*token id 10 is 'w7' in the target and 'w7x'"):
        check_same_tokenizer(ours, theirs, "target-y", "draft-x")
    # through the real loading path: a draft directory whose tokenizer differs
    target_dir, draft_dir = pattern_dirs("llama")
    theirs.save_pretrained(draft_dir.parent / "odd-draft")
    import shutil

    for f in draft_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, draft_dir.parent / "odd-draft" / f.name)
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        load_pair(str(target_dir), str(draft_dir.parent / "odd-draft"), device="cpu", dtype="float32")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", ""], "prompt is empty"),
        ([], "no prompt: give one"),
        ([""], "prompt is empty"),  # as a positional argument too
        (["--prompt", "hi", "--gamma", "0"], "gamma"),
        (["--prompt", "hi", "--max-new-tokens", "100000"], "max_new_tokens"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    ],
)
def test_cli_rejects_bad_input_before_loading(monkeypatch, capsys, argv, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("models were loaded for a bad request")

    monkeypatch.setattr(cli, "load_pair", no_loading)
    assert cli.main(["generate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_does():
    """`--help` of each command: no option without a line saying what it does."""
    import argparse

    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"generate", "bench", "check", "distill", "kernels", "bench-render", "bench-page"} <= set(commands)
    bare = [f"{name} {action.option_strings[-1]}" for name, parser in commands.items() for action in parser._actions
            if action.option_strings and not (action.help or "").strip()]
    assert bare == []
