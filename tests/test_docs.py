"""The README and docs/design.md against the code and the results they quote (CPU, fast).

- the README's runnable example (after ``<!-- example -->``) runs and prints what it promises;
- every figure in a README results table (after ``<!-- results: FOLDER -->``) occurs in a file of
  the results folder that the table cites;
- the README stays short;
- every path under docs/ or bench/ that the README or design.md names exists, or, where the text
  says "PATH at COMMIT", existed at that commit (checked where git has the commit).
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DESIGN = ROOT / "docs" / "design.md"
MAX_README_LINES = 245  # (two install routes, the terms, and SGLang's section beside vLLM's)
RESULT_SUFFIXES = (".csv", ".json", ".log", ".txt")
TOLERANCE_BF16 = 1.6e-2  # tests/rank_cases.TOL[torch.bfloat16]


def _fenced_block_after(text: str, marker: str, lang: str) -> str:
    m = re.search(re.escape(marker) + r"\s*```" + lang + r"\n(.*?)```", text, re.S)
    assert m, f"no ```{lang} block after {marker} in README.md"
    return m.group(1)


TRY_IT = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 triton==3.6.0 '
          '$(nvidia-smi -L > /dev/null 2>&1 || echo --extra-index-url https://download.pytorch.org/whl/cpu)')
BENCH = 'pip install -e ".[bench]" && python -m dcp.bench'
TESTS = 'pip install -e ".[test,bench]" && python3 -m pytest -q'
SERVING = "pip install --no-deps . && python -m dcp.doctor"


def _opening_commands() -> list:
    """The README's first code block as bash reads it: continued lines joined, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.startswith("#")]


def test_readme_opens_with_the_two_routes():
    """Issue 42: "Try it" in a venv of its own (torch's CPU build without a GPU), the benchmark by
    its installed name, the tests; and the serving environment's route, which leaves its torch and
    Triton alone and asks the doctor about them."""
    text = README.read_text()
    assert text.index("```bash") < text.index("\n## "), "the commands are not the README's first thing"
    assert [" ".join(c.split()) for c in _opening_commands()] == [TRY_IT, BENCH, TESTS, SERVING]
    block = text[text.index("```bash"):text.index("```", text.index("```bash") + 3)]
    assert "# Try it, in a venv of its own" in block and "# Add it to my serving environment" in block


def test_ci_runs_the_readmes_venv_and_test_command():
    """CI runs the "Try it" line and command 2 as the README writes them."""
    ci = [" ".join(line.split()) for line in (ROOT / ".ci" / "run").read_text().replace("\\\n", " ").splitlines()]
    assert TRY_IT in ci and TESTS in ci, "the README's commands are not in .ci/run as written"
    assert ci.index(TRY_IT) < ci.index(TESTS)


def test_readme_example_runs(tmp_path):
    code = _fenced_block_after(README.read_text(), "<!-- example -->", "python")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    n = int(re.search(r"^N, B, H, D = (\d+),", code, re.M).group(1))
    found = dict(re.findall(r"rank (\d+): combine max error ([0-9.]+), gather exact True$", proc.stdout, re.M))
    assert sorted(found) == [str(r) for r in range(n)], proc.stdout
    assert all(float(err) <= TOLERANCE_BF16 for err in found.values()), proc.stdout


def _tables_after_markers(text: str) -> list:
    """(folder, [row cells]) for each ``<!-- results: FOLDER -->`` and the table that follows it."""
    tables = []
    for m in re.finditer(r"<!-- results: (\S+?) -->\n((?:\|.*\|\n)+)", text):
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in m.group(2).splitlines()]
        assert len(rows) > 2 and set("".join(rows[1])) <= set("-: "), f"malformed table after {m.group(0)[:40]}"
        tables.append((m.group(1), rows[2:]))
    return tables


def _number_in(number: str, text: str) -> bool:
    """Whether ``number`` occurs in ``text`` as a whole figure (3.7 is not in 13.7 or 3.75)."""
    return re.search(r"(?<![\d.])" + re.escape(number) + r"(?!\d)", text) is not None


def test_readme_results_figures_come_from_their_folders():
    text = README.read_text()
    results = text[text.index("## Results"):]
    results = results[:results.find("\n## ", 1)]
    tables = _tables_after_markers(results)
    # every table of the results section cites its folder
    assert len(tables) == results.count("\n| --- ") >= 2, "a results table without its <!-- results: --> marker"
    for folder, rows in tables:
        path = ROOT / folder
        assert path.is_dir(), f"{folder} does not exist"
        assert f"`{folder.rstrip('/')}/`" in results, f"the text does not name {folder}"
        files = [p for p in path.rglob("*") if p.suffix in RESULT_SUFFIXES]
        assert (path / "README.md").exists() and files, f"{folder}: no README.md or no data files"
        corpus = "\n".join(p.read_text(errors="replace") for p in files)
        checked = 0
        for row in rows:
            for cell in row:
                for number in re.findall(r"\d+(?:\.\d+)?%?", cell):
                    assert _number_in(number, corpus), f"{folder}: {number!r} (row {row}) is in none of its files"
                    checked += 1
        assert checked >= 5 * len(rows)


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def _git_has(commit: str, path: str):
    """Whether ``path`` existed at ``commit``; None where git or the commit is not available."""
    git = shutil.which("git")
    if git is None:
        return None
    run = lambda *a: subprocess.run([git, "-C", str(ROOT), *a], capture_output=True, timeout=30)  # noqa: E731
    if run("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    return run("cat-file", "-e", f"{commit}:{path}").returncode == 0


PATH = re.compile(r"(?<![\w/.-])((?:docs|bench)/[\w./-]*)")
AT_COMMIT = re.compile(r"`?\s+at\s+(?:commit\s+)?([0-9a-f]{7,40})\b")  # "PATH at COMMIT"
COMMIT_COLON = re.compile(r"\b([0-9a-f]{7,40}):$")  # "COMMIT:PATH", as git show takes it


@pytest.mark.parametrize("doc", [README, DESIGN], ids=lambda p: p.name)
def test_named_paths_exist(doc):
    text = doc.read_text()
    missing, historical = [], 0
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,;:")
        at = AT_COMMIT.match(text, m.end()) or COMMIT_COLON.search(text[max(0, m.start() - 41):m.start()])
        if at:
            historical += 1
            if _git_has(at.group(1), path.rstrip("/")) is False:
                missing.append(f"{path} at {at.group(1)}")
        elif not (ROOT / path).exists():
            missing.append(path)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"
    if doc is DESIGN:
        assert not (ROOT / "docs" / "NOTES.md").exists() and historical > 0
