"""The documents hold to what they are for: a README a user reads on one sitting, current facts only, the two
commands it promises, the engineers' pages it links, and code comments that say why, not where a run was told."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTIONS = ["Quick start", "What the page shows", "Drafters and settings", "How fast", "Use it from Python",
            "The command line", "Deploying", "Exactness", "Development"]


def test_the_readme_is_short_and_its_sections_come_in_a_users_order():
    assert len(README.splitlines()) <= 300
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings == SECTIONS


def test_the_readme_states_current_facts_without_dates_sessions_or_commits():
    prose = README.split("<!-- speed tables")[0] + README.split("<!-- /speed -->")[1]  # the report's block aside
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", prose)
    assert not re.findall(r"\b(first|second|third|\w+th) session\b", prose, re.I)
    assert not re.findall(r"\bCPU [ABC]\b", prose)
    assert not re.findall(r"\bissue [A-Z]\b", prose)


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    dev = README.split("## Development", 1)[1]
    assert re.search(r"```bash\n(.*?)\n```", dev, re.S).group(1) == ci


def test_the_linked_documents_exist():
    for link in re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)\)", README):
        assert (ROOT / link).is_file(), link
    assert {"docs/architecture.md", "docs/kernels.md", "docs/eagle.md", "BENCHMARKS.md", "CHANGELOG.md"} <= set(
        re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)\)", README))


def test_code_comments_do_not_cite_issues_benchmark_sections_or_sessions():
    cited = []
    for path in [*ROOT.glob("specviz/**/*.py"), *ROOT.glob("specviz/**/*.c"), ROOT / "app.py"]:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bissue [A-Z]\b|BENCHMARKS\.md,? \(?\"|BRIEF\.md|\b\w+th session\b|\bCPU [ABC]\b", line):
                cited.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not cited, "\n".join(cited)
