"""The Dockerfile, as far as a machine with no Docker engine can check it: a linter, and its
install steps replayed in a fresh virtual environment, then the app started in public mode."""

import re
import shutil
import site
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_server import ROOT, start_server

pytestmark = [pytest.mark.slow, pytest.mark.offline_model]


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_follows_the_spaces_conventions():
    text = dockerfile()
    assert re.search(r"useradd .*--uid 1000", text) and "USER 1000" in text
    assert "EXPOSE 7860" in text and "GRADIO_SERVER_PORT=7860" in text and "HF_HOME=" in text
    assert "SPECVIZ_PUBLIC=1" in text and "trust_remote_code" not in text


def run_steps(text: str) -> list[str]:
    """The RUN commands, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line[4:].strip() for line in joined.splitlines() if line.startswith("RUN ")]


def test_install_steps_in_a_fresh_venv_then_public_app(tmp_path):
    """The Dockerfile's RUN steps, in order, in a fresh environment that sees this one's packages (as
    test_package does, through a .pth file): pip must find every pin already satisfied with no index,
    so a pin the README's setup would not install fails here, and the steps after it run as written."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    fresh_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                                capture_output=True, text=True).stdout.strip()
    Path(fresh_site, "setup-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = f"{py} -m pip"
    for step in run_steps(dockerfile()):
        if "pip install" not in step and not step.startswith("python "):
            continue  # creating the container's user is for the container
        command = step.replace("pip install", f"{pip} install --no-index").replace(" --user", "")
        command = re.sub(r"^python ", f"{py} ", command)
        subprocess.run(command, shell=True, cwd=ROOT, check=True, timeout=1200)
    proc, url = start_server(py, {"SPECVIZ_PUBLIC": "1"})
    try:
        with urllib.request.urlopen(url, timeout=30) as page:
            assert page.status == 200 and "specviz" in page.read().decode()
    finally:
        proc.kill()
        proc.wait(timeout=30)
