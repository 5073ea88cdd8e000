"""The docs describe the repository as it is: every repository path a doc names exists, every
`python -m shardmoe...` module it runs exists, every section it cites by name ("docs/X.md,
"Title"") is a heading or a bold lead of that doc, every link inside docs/ resolves, every script in
benchmarks/ has a row in its index and is cited by the docs that row names, and no doc, comment or
test cites the tracker ("issue 9") or narrates history ("today's", "used to").

docs/history/ is a dated record and is not held to the present; nor are the lease reports under
docs/gpu/ (each a run's output, at the commit and with the command it records)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACKED_DIRS = ("shardmoe", "tests", "docs", "benchmarks", "examples")


def _repository_files() -> list[str]:
    paths = [p.name for p in ROOT.iterdir() if p.is_file()]
    for top in TRACKED_DIRS:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                paths.append(path.relative_to(ROOT).as_posix())
    return paths


FILES = _repository_files()
NAMES = set(FILES) | {"/".join(f.split("/")[:i]) for f in FILES for i in range(1, f.count("/") + 1)}


def _is_record(path: str) -> bool:
    """A dated record: docs/history/, or a lease's report directory under docs/gpu/."""
    return path.startswith("docs/history/") or (path.startswith("docs/gpu/") and path.count("/") >= 3)


def _docs() -> list[str]:
    """The present-tense docs: docs/ outside its records, and the READMEs."""
    return sorted(f for f in FILES if f.endswith(".md") and not _is_record(f)
                  and (f.startswith("docs/") or f in ("README.md", "benchmarks/README.md")))


def _exists(path: str) -> bool:
    """path names a repository file or folder, from the root or from any folder (`moe/experts.py`,
    `csrc/experts_mm.cpp` and `test_layer.py` are written relative to the folder a doc is about)."""
    path = path.rstrip("/")
    return any(name == path or name.endswith("/" + path) for name in NAMES)


SOURCE_SUFFIXES = (".py", ".sh", ".cpp", ".md")


def _looks_like_a_repository_path(token: str) -> bool:
    """A source file (`x.py`, `moe/x.py`) or a path under a repository folder (`docs/gpu/...`);
    placeholders (`DIR/...`), absolute paths, run outputs (`metrics.jsonl`) and slashed prose
    (`dL/dx`, `peak/tf`) are not."""
    if not re.fullmatch(r"[\w./-]+", token) or token.startswith(("/", "~", "-")) or ".." in token:
        return False
    if any(part.isupper() for part in re.split(r"[/.]", token) if part):
        return False
    return token.endswith(SOURCE_SUFFIXES) or token.split("/")[0] in TRACKED_DIRS and "/" in token


def test_every_repository_path_a_doc_names_exists():
    missing = []
    for doc in _docs():
        for token in re.findall(r"`([^`\n]+)`", (ROOT / doc).read_text()):
            for word in token.split():
                word = word.split("::")[0].rstrip(",;:)")
                if _looks_like_a_repository_path(word) and not _exists(word):
                    missing.append(f"{doc}: {word}")
    assert not missing, "paths named in docs that the repository does not hold:\n" + "\n".join(missing)


def test_every_module_a_doc_runs_exists():
    missing = []
    for doc in _docs():
        for module in re.findall(r"-m (shardmoe(?:\.\w+)*)", (ROOT / doc).read_text()):
            as_path = module.replace(".", "/")
            if as_path + ".py" not in NAMES and as_path + "/__init__.py" not in NAMES:
                missing.append(f"{doc}: python -m {module}")
    assert not missing, "modules run in docs that do not exist:\n" + "\n".join(missing)


def _titles(doc: str) -> list[str]:
    """The headings and bold paragraph leads of a doc, without markdown."""
    text = (ROOT / doc).read_text()
    titles = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    titles += re.findall(r"^(?:- )?\*\*([^*]+)\*\*", text, re.M)
    return [t.replace("`", "") for t in titles]


def test_every_section_cited_by_name_exists():
    """`docs/X.md, "Title"` (in docs, comments and tests) names a heading or bold lead of X.md."""
    missing = []
    cited_in = [f for f in FILES if f.endswith((".md", ".py", ".sh")) and not _is_record(f)]
    for source in cited_in:
        text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", (ROOT / source).read_text(errors="replace"))
        for doc, title in re.findall(r"(?:docs/)?([a-z][\w-]*\.md)[,:]? \(?\"([^\"]+)\"", text):
            if not (ROOT / "docs" / doc).is_file():
                missing.append(f'{source}: docs/{doc} (no such doc), "{title}"')
                continue
            title = title.replace("`", "")
            if not any(t.startswith(title) for t in _titles("docs/" + doc)):
                missing.append(f'{source}: docs/{doc}, "{title}"')
    assert not missing, "sections cited that their doc does not have:\n" + "\n".join(missing)


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")


def test_every_link_between_docs_resolves():
    broken = []
    for doc in _docs():
        text = (ROOT / doc).read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (ROOT / doc).parent / file if file else ROOT / doc
            if not linked.exists():
                broken.append(f"{doc}: {target}")
            elif anchor and linked.suffix == ".md":
                anchors = {_anchor(line.lstrip("#")) for line in linked.read_text().splitlines()
                           if line.startswith("#")}
                if anchor not in anchors:
                    broken.append(f"{doc}: {target}")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)



def test_every_benchmark_script_is_indexed_and_cited_by_the_docs_its_index_names():
    """benchmarks/ keeps only scripts a doc cites: each has a row in benchmarks/README.md, and every
    doc its row's "cited by" column names (docs/X.md, or README.md) cites the script."""
    index = {}
    for row in (ROOT / "benchmarks" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]  # at |, not \|
        if len(cells) == 4 and cells[0].startswith("`"):
            index[cells[0].strip("`")] = re.findall(r"(?:docs/[\w-]+|README)\.md", cells[2])
    scripts = sorted(f.removeprefix("benchmarks/") for f in FILES if f.startswith("benchmarks/")
                     and f != "benchmarks/README.md" and "/" not in f.removeprefix("benchmarks/"))
    assert sorted(index) == scripts, "benchmarks/README.md's rows against the scripts in benchmarks/"
    uncited = [f"{script}: no doc named" for script, docs in index.items() if not docs]
    uncited += [f"{script}: {doc}" for script, docs in index.items() for doc in docs
                if script not in (ROOT / doc).read_text()]
    assert not uncited, "benchmark scripts their index says a doc cites, which it does not:\n" + "\n".join(uncited)


TRACKER = re.compile(r"\bissues? #?\d+|\bitems? \d+(?:-\d+)? of (?:the )?issue", re.I)
NARRATION = re.compile(r"\btoday's\b|(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bwas )(?<!\bwere )\bused to\b",
                       re.I)


def test_no_tracker_numbers_or_history_narration():
    """The tracker is not in the repository and history lives in git: a reason is given in the
    present tense ("without this check, X happens")."""
    checked = [f for f in FILES if f.endswith((".md", ".py", ".sh", ".cpp", ".toml"))
               and not _is_record(f) and f != "tests/test_docs.py"]
    found = []
    for path in checked:
        for number, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1):
            if TRACKER.search(line) or NARRATION.search(line):
                found.append(f"{path}:{number}: {line.strip()}")
    assert not found, "tracker numbers or history narration:\n" + "\n".join(found)


# A figure: a measured quantity, a number with a unit of time, a speed ratio or a rate.
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?[x×](?!\w)|\d+(?:\.\d+)?\s?(?:ms|µs|us|ns|s|min)\b(?!/)"
                    r"|\d+(?:\.\d+)?\s?(?:[GTMk]FLOP/s|[GTM]B/s|tokens/s|tok/s))")
# What reproduces one: a command (a runner, after any VAR=value), as a doc writes it in a code span
# or a fenced block
COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:python3?|\.venv/bin/python|/usr/bin/time\b.*python|shardmoe|make|"
                     r"pytest|torchrun|time\s+\S)")


def _constants() -> set[str]:
    """The package's module-level constants (UPPER_CASE = ..., private ones too): a number a doc quotes
    from the code."""
    found = set()
    for path in (ROOT / "shardmoe").rglob("*.py"):
        found.update(re.findall(r"^(_?[A-Z][A-Z0-9_]+)\s*(?::[^=\n]*)?=", path.read_text(), re.M))
    return found


def _blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(kind, section, lines) of each paragraph, table, fenced block and heading, in order."""
    blocks, lines, kind, fence, section = [], [], None, False, 0
    for line in text.split("\n"):
        if line.startswith("```"):
            if fence:
                blocks.append(("code", section, lines + [line]))
                lines, fence = [], False
                continue
            if lines:
                blocks.append((kind, section, lines))
            lines, fence = [line], True
            continue
        if fence:
            lines.append(line)
            continue
        if line.startswith("#") or not line.strip():
            if lines:
                blocks.append((kind, section, lines))
            lines = []
            if line.startswith("#"):
                section += 1
                blocks.append(("heading", section, [line]))
            continue
        line_kind = "table" if line.lstrip().startswith("|") else "text"
        if lines and line_kind != kind:
            blocks.append((kind, section, lines))
            lines = []
        kind = line_kind
        lines.append(line)
    if lines:
        blocks.append((kind, section, lines))
    return blocks


def _cites_a_source(block, constants: set[str]) -> bool:
    """Whether the block holds a command, a constant of the package or a dated record's path."""
    kind, _, lines = block
    if kind == "code":
        return any(COMMAND.match(line.strip().lstrip("$ ")) for line in lines[1:-1])
    for span in re.findall(r"`([^`]+)`", "\n".join(lines)):  # a code span may run over a line break
        span = " ".join(span.split())
        if COMMAND.match(span) or span.split(".")[-1] in constants or _is_record(span):
            return True
    return False


def test_every_figure_cites_what_reproduces_it():
    """Every paragraph or table of the README and the present-tense docs that quotes a figure (a time,
    a speed ratio, a rate) has, in itself, the paragraph or table just before or after it in the
    same section, or the caption of the table it follows, what reproduces it: the command that measured it (in a code span or a fenced
    block), the package constant it quotes (`kernels.KERNEL_MAX_FFN`), or the dated record that
    holds the run and its command (a lease report under docs/gpu/, docs/history/). The commands'
    scripts and modules exist: the tests above hold every path and module a doc names."""
    constants = _constants()
    uncited = []
    for doc in (d for d in _docs() if d != "benchmarks/README.md"):
        blocks = _blocks((ROOT / doc).read_text())
        for i, block in enumerate(blocks):
            if block[0] in ("code", "heading"):
                continue
            figures = FIGURE.findall(re.sub(r"`[^`]*`", "", "\n".join(block[2])))
            if not figures:
                continue
            # itself, its neighbours, and the caption of a table just before it (the runs it reads)
            around = [i - 1, i, i + 1] + ([i - 2] if i >= 1 and blocks[i - 1][0] == "table" else [])
            near = [blocks[j] for j in around if 0 <= j < len(blocks) and blocks[j][1] == block[1]]
            if not any(_cites_a_source(b, constants) for b in near):
                uncited.append(f"{doc}: {', '.join(figures[:3])} in: {block[2][0][:90]}")
    assert not uncited, "figures without the command that measured them:\n" + "\n".join(uncited)


def test_every_new_run_in_the_training_examples_names_its_own_out():
    """README.md and docs/training.md say their examples run as written in sequence, after `make run`
    (which keeps runs/default): a new run (not --resume, --overwrite or --help) into a directory
    holding one is refused, so each names an --out of its own."""
    for doc in ("README.md", "docs/training.md"):
        outs, fenced = {}, False
        # a line continued with a backslash as one, an empty line in its continuation's place
        lines = re.sub(r"\\\n(.*)", r" \1\n", (ROOT / doc).read_text()).splitlines()
        for number, line in enumerate(lines, start=1):
            if line.startswith("```"):
                fenced = not fenced
                continue
            code = fenced or line.startswith("    ")
            if not code or not re.search(r"(^|[\s/])shardmoe train\b", line.split("#")[0]):
                continue
            command = line.split("#")[0]
            if any(flag in command for flag in ("--resume", "--overwrite", "--help")):
                continue
            out = re.search(r"--out (\S+)", command)
            assert out and out[1] != "runs/default", f"{doc}:{number}: a new run without an --out of its own: {line}"
            assert out[1] not in outs, f"{doc}:{number}: --out {out[1]} again (line {outs.get(out[1])})"
            outs[out[1]] = number
