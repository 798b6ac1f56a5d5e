"""specviz as an installed library: `pip install .` in a fresh virtual environment gives a
`specviz` command that runs the offline pair from the installed package; the README's Python
example runs; a run draws itself in a notebook, its token text escaped."""

import dataclasses
import os
import re
import site
import subprocess
import venv
from pathlib import Path

import pytest
from conftest import words

from specviz.core.events import ExtraToken
from specviz.core.generator import Settings, generate
from specviz.tools.stream import Finished

ROOT = Path(__file__).resolve().parent.parent


def test_a_run_draws_itself_with_its_tokens_escaped(random_pair):
    run = generate(random_pair, "", Settings(gamma=2, temperature=1.0, max_new_tokens=6, seed=1),
                   prompt_ids=words(1, 2))
    base = generate(random_pair, "", Settings(temperature=1.0, max_new_tokens=6, seed=1), mode="baseline",
                    prompt_ids=words(1, 2))
    last = run.events[-1]
    run.events[-1] = dataclasses.replace(last, extra=ExtraToken(3, "<b>&x", "bonus", 0.5))
    page = run._repr_html_()
    assert "&lt;b&gt;&amp;x" in page and "<b>&x" not in page  # untrusted model text, escaped
    assert page.count('class="sv-tok') >= run.n_tokens and "acceptance rate" in page and "plotly" in page
    both = Finished([run, base])._repr_html_()
    assert "baseline (target alone)" in both and "speedup" in both and both.count('class="sv-stream"') == 2


@pytest.mark.slow
@pytest.mark.offline_model
def test_the_readme_python_example_runs(tmp_path, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "round 1: " in out and "tokens per round" in out and (tmp_path / "trace.json").exists()


@pytest.mark.slow
@pytest.mark.offline_model
def test_pip_install_into_a_fresh_venv_gives_a_working_specviz_command(tmp_path):
    """The fresh environment sees this one's packages (torch and the rest, as the README's setup
    installed them, setuptools among them) through a .pth file, so pip builds and installs
    specviz itself and nothing else, with no index at all."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    fresh_site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                                capture_output=True, text=True).stdout.strip()
    Path(fresh_site, "setup-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # the venv's own (older) setuptools would shadow the one the .pth file brings
    subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", "setuptools"], capture_output=True)
    install = subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-build-isolation", str(ROOT)],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    command = env_dir / "bin" / "specviz"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    help_text = subprocess.run([command, "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert help_text.returncode == 0 and "generate" in help_text.stdout and "distill" in help_text.stdout
    show = ("import specviz.models.loading as m, specviz.models.native as n; print(m.__file__); print(m.ASSETS); "
            "print(n.SOURCE if n.SOURCE.is_file() else 'no-kernel-source')")
    where = subprocess.run([python, "-c", show], capture_output=True, text=True, env=env, cwd=tmp_path).stdout.split()
    assert len(where) == 3 and all(path.startswith(fresh_site) for path in where), where  # the copy, assets, C source
    run = subprocess.run([command, "generate", "The future of AI", "--max-new-tokens", "6",
                          "--color", "never"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "speculative: 6 tokens" in run.stdout and "EAGLE head eagle-smollm2-135m" in run.stdout


def test_a_missing_shipped_draft_says_where_it_looked(monkeypatch, tmp_path):
    from specviz.models import loading as models

    monkeypatch.setattr(models, "SHIPPED_DRAFT", tmp_path / "draft-smollm2-135m")
    with pytest.raises(RuntimeError, match="looked in .*assets/draft-smollm2-135m or .*assets/draft-smollm2-135m"):
        models.shipped_draft_dir()
