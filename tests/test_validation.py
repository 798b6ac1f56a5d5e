"""Bad input gets a clear ValueError before any model work, and nothing is left half-done."""

import dataclasses
import re

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


def test_a_missing_folder_is_named_before_any_model_loads(monkeypatch, tmp_path):
    from specviz.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match="holds no EAGLE head"):
        load_pair(preset="offline", head=str(tmp_path / "no-head"), device="cpu", dtype="float32")
    for ref in (str(tmp_path / "no-model"), "./no-model", "~/no-model"):
        with pytest.raises(ValueError, match=f"no model folder at {re.escape(ref)}"):
            resolve_model_path(ref)
    monkeypatch.setattr(loading, "hub_reachable", lambda: True)
    assert resolve_model_path("org/model-name") == "org/model-name"  # a hub id is left to the hub


def test_a_path_that_holds_no_model_is_told_one_sentence_whatever_is_there(tmp_path):
    """A server's visitor learns nothing of which paths exist: a missing path, a folder of other things and a
    folder that fails to load are all 'no model folder at …' (what failed goes to the console)."""
    import torch

    from specviz.models.loading import load_model

    said = []
    for folder in ("/etc", str(tmp_path), str(tmp_path / "missing")):
        with pytest.raises(ValueError, match=f"^no model folder at {re.escape(folder)}: "):
            load_model(folder, torch.device("cpu"), torch.float32, said.append)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match=f"^no model folder at {re.escape(str(tmp_path))}: "):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32, said.append)
    assert said[-1].startswith(f"loading {tmp_path} failed: ")


def test_a_hub_id_fails_at_once_where_the_hub_cannot_be_reached(monkeypatch, tmp_path):
    """Offline, a hub id not in the local cache is refused within seconds, saying why (not after the hub client's
    minute of retries); one in the cache loads from there."""
    import socket
    import time

    from huggingface_hub import constants

    from specviz.models import loading

    def refused(*args, **kwargs):
        time.sleep(0.05)
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"cannot reach the model hub \(huggingface.co\) to download 'gpt2', and "
                                         r"it is not in the local cache: this machine looks offline"):
        load_pair("gpt2", "distilgpt2", device="cpu", dtype="float32")
    assert time.perf_counter() - started < 5
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    assert loading.resolve_model_path("org/cached") == str(snapshot)


def test_missing_local_model_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no model folder at .*missing-target"):
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


DISTILL = ["distill", "--target", "offline", "--out", "x"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--repeats", "0"], "--repeats must be at least 1, got 0"),
        (["bench", "--gammas", "2,a"], "--gammas: expected comma-separated int values, got '2,a'"),
        (["bench", "--temperatures", "0,-1"], "temperature"),
        (["bench", "--batch", "-1"], "--batch must be at least 0"),
        (["bench-page", "--threads", "0"], "--threads must be at least 1"),
        (["bench-page", "--update-s", "nan"], "--update-s must be a number of seconds >= 0"),
        (["bench-page", "--max-new-tokens", "0"], "max_new_tokens"),
        (["check", "--only", "nosuch"], "no case's name contains 'nosuch'"),
        (["kernels", "--repeats", "0"], "--repeats must be at least 1"),
        (["bench-render", "--repeats", "0"], "--repeats must be at least 1"),
        (["generate", "--prompt", "hi", "--branch", "0"], "branch"),
        (["generate", "--prompt", "hi", "--temperature", "1", "--sample-check", "0"], "--sample-check must be at"),
        (["generate", "--prompt", "hi", "--sample-check", "5"], "--sample-check needs --temperature > 0"),
        ([*DISTILL, "--gen-batch", "0"], "gen_batch"),
        ([*DISTILL, "--batch", "0"], "error: batch must be"),
        ([*DISTILL, "--holdout", "1.5"], "holdout"),
        ([*DISTILL, "--lr", "-1"], "lr must be a finite number >= 0"),
        ([*DISTILL, "--kind", "eagle", "--temperatures", "0,x"], "--temperatures: expected comma-separated float"),
        ([*DISTILL, "--kind", "eagle", "--temperatures", "-1"], "temperatures[0]"),
        ([*DISTILL, "--train-minutes", "0", "--max-steps", "0"], "train_minutes > 0 or max_steps"),
        ([*DISTILL, "--gen-temperature", "0"], "gen_temperature must be > 0"),
        ([*DISTILL, "--hidden", "100", "--heads", "3"], "must split into its heads"),
    ],
)
def test_every_command_rejects_bad_input_before_loading(monkeypatch, capsys, argv, message):
    """Each command checks its options before any model loads: a bad one is a one-line error (exit 2), not a
    traceback minutes into a run."""
    from specviz.tools import distill, pagebench

    def no_loading(*args, **kwargs):
        raise AssertionError("models were loaded for a bad request")

    monkeypatch.setattr(cli, "load_pair", no_loading)
    monkeypatch.setattr(distill, "load_model", no_loading)
    monkeypatch.setattr(pagebench, "page_runs", no_loading)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_trace_path_is_checked_before_the_run(monkeypatch, capsys, tmp_path):
    """--trace to a folder fails before loading; a missing parent folder is made, so the run is not lost."""
    monkeypatch.setattr(cli, "load_pair", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert cli.main(["generate", "--prompt", "hi", "--trace", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="loaded"):  # got as far as loading: the path was accepted
        cli.main(["generate", "--prompt", "hi", "--trace", str(tmp_path / "new" / "run.json")])
    assert (tmp_path / "new").is_dir()


@pytest.mark.slow
def test_an_app_that_stops_before_serving_says_why():
    """bench-page's app, stopped by a bad setting at start-up: the error carries the app's own line, not a bare
    "did not start"."""
    from specviz.tools import pagebench

    with pytest.raises(RuntimeError, match="SPECVIZ_QUEUE_SIZE must be a whole number of at least 1, got '0'"):
        pagebench._serve({"SPECVIZ_QUEUE_SIZE": "0"}, progress=lambda m: None)


def test_distill_config_validate():
    from specviz.tools.distill import DistillConfig

    good = DistillConfig("t", "o")
    good.validate("eagle")
    good.validate("draft")
    for kind, fields, message in [
        ("eagle", dict(prompts=1), "prompts"),
        ("eagle", dict(top_k=0), "top_k"),
        ("eagle", dict(new_tokens=2.5), "new_tokens"),
        ("eagle", dict(gen_batch=True), "gen_batch"),
        ("eagle", dict(draft_vocab=0), "draft_vocab"),
        ("eagle", dict(temperatures=()), "at least one"),
        ("eagle", dict(temperatures=(0.0, float("nan"))), "temperatures[1]"),
        ("eagle", dict(train_minutes=float("inf")), "train_minutes"),
        ("eagle", dict(holdout=1.0), "holdout"),
        ("draft", dict(kv_heads=0), "kv_heads"),
        ("draft", dict(heads=4, kv_heads=3), "key-value heads"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(good, **fields).validate(kind)
    dataclasses.replace(good, temperatures=()).validate("draft")  # a draft's data uses gen_temperature only
    dataclasses.replace(good, draft_vocab=0).validate("draft")


def test_every_option_of_every_command_says_what_it_does():
    """`--help` of each command: no option without a line saying what it does."""
    import argparse

    commands = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"generate", "bench", "check", "distill", "kernels", "bench-render", "bench-page"} <= set(commands)
    bare = [f"{name} {action.option_strings[-1]}" for name, parser in commands.items() for action in parser._actions
            if action.option_strings and not (action.help or "").strip()]
    assert bare == []


def test_an_unwritable_cache_falls_back_to_a_temporary_folder_and_says_so(monkeypatch, tmp_path, caplog):
    """A read-only home or a bad SPECVIZ_CACHE: the cache moves to the system's temporary folder, with a warning
    naming both, instead of a traceback at the first model conversion or kernel table."""
    from specviz.models import cachedir

    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(cachedir.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "a-file" / "cache"))
    with caplog.at_level("WARNING", logger="specviz"):
        root = cachedir.cache_root()
    assert root.parent == tmp_path / "tmp" and root.is_dir()
    assert f"cannot keep its cache in {tmp_path / 'a-file' / 'cache'}" in caplog.text and str(root) in caplog.text
    monkeypatch.setenv("SPECVIZ_CACHE", str(tmp_path / "fine"))
    assert cachedir.cache_root() == tmp_path / "fine" and (tmp_path / "fine").is_dir()


def test_ctrl_c_outside_a_run_is_a_line_not_a_traceback(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_pair", interrupted)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip() == "stopped (Ctrl-C)"
