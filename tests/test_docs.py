"""The README and docs/: links resolve, named paths exist, and stated facts match the repo.

The README is the entry point; docs/ holds one page per topic. These tests read them as text
and check them against the tree, so a moved page, a renamed module or a changed manifest
shows up as a failing test rather than as a dead link.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def prose(path: Path) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path):
        m = re.match(r"^#{1,6} (.+)$", line)
        if not m:
            continue
        base = slug(m[1])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def section(path: Path, title: str) -> str:
    """The text of one `## title` section, up to the next heading of level 1 or 2."""
    text = path.read_text()
    start = text.index(f"\n## {title}\n")
    nxt = re.search(r"\n#{1,2} ", text[start + 1 :])
    return text[start : start + 1 + nxt.start()] if nxt else text[start:]


def test_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    bad = []
    for line in prose(page):
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                bad.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{target}: no heading with that anchor")
    assert not bad, bad


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {
        (ROOT / t.partition("#")[0]).resolve()
        for line in prose(README)
        for t in LINK.findall(line)
        if t.startswith("docs/")
    }
    assert linked >= {p.resolve() for p in DOCS.glob("*.md")}


def test_the_two_commands_are_the_ones_ci_runs() -> None:
    text = README.read_text()
    assert "\npip install '.[loadtest]' && prefix-router demo\n" in text
    assert "\n./scripts/test.sh\n" in text
    assert './scripts/test.sh --python "$python"' in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "scripts" / "test.sh").stat().st_mode & 0o111


def test_request_flow_map_names_modules_that_exist() -> None:
    text = section(README, "How a request flows")
    paths = set(re.findall(r"`(router/[\w/]+(?:\.py)?)`", text))
    assert len(paths) >= 10, paths  # every stage names its module
    for p in paths:
        assert (ROOT / p).exists(), p
    # A named function or class exists in the module the map puts it in.
    for module, names in re.findall(r"`(router/[\w/]+\.py)` \(([^)]*)\)", text):
        source = (ROOT / module).read_text()
        for name in re.findall(r"`(\w+)`", names):
            short = name.split(".")[-1]
            assert re.search(rf"\b(def|class) {short}\b", source), (module, name)
    for qualified in re.findall(r"`Gateway\.(\w+)`", text):
        assert re.search(rf"def {qualified}\b", (ROOT / "router" / "gateway.py").read_text())


REPO_PATH = re.compile(r"`((?:router|loadtest|tests|tools|deploy|scripts)/[\w./-]+)`")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_repo_paths_named_in_prose_exist(page: Path) -> None:
    missing = []
    for line in prose(page):
        for p in REPO_PATH.findall(line):
            p = p.rstrip(".")
            if any(ch in p for ch in "{}*<>"):  # a pattern, not a path
                continue
            if not (ROOT / p).exists():
                missing.append(p)
    assert not missing, missing


def redis_policy_in_manifests() -> set[str]:
    policies = set()
    compose = yaml.safe_load((ROOT / "deploy" / "compose" / "fleet.yaml").read_text())
    args = compose["services"]["redis"]["command"]
    policies.add(args[args.index("--maxmemory-policy") + 1])
    for doc in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "redis.yaml").read_text()):
        if doc and doc.get("kind") == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                a = c.get("args", [])
                if "--maxmemory-policy" in a:
                    policies.add(a[a.index("--maxmemory-policy") + 1])
    return policies


def test_redis_advice_matches_the_manifests() -> None:
    policies = redis_policy_in_manifests()
    assert len(policies) == 1, policies
    (policy,) = policies
    stated = set()
    for page in PAGES:
        stated |= set(re.findall(r"maxmemory-policy[` ]+([a-z-]+)", page.read_text()))
    assert stated == {policy}, stated


def test_conformance_instructions_stay_inside_the_repo() -> None:
    for page in PAGES:
        text = page.read_text()
        assert "shared/tools" not in text, page
        assert "../shared" not in text, page
    text = (DOCS / "prompt-rendering.md").read_text()
    assert "tools/make_oracle_fixtures.py" in text and "tests/test_conformance.py" in text


def test_test_script_announces_each_install_before_it_runs() -> None:
    """scripts/test.sh installs packages (system ones too): each install line is preceded by
    a line that says what it is about to install."""
    lines = [x.strip() for x in (ROOT / "scripts" / "test.sh").read_text().splitlines()]
    installs = [i for i, x in enumerate(lines) if re.search(r"\b(pip|apt-get) install\b", x)]
    installs = [i for i in installs if not lines[i].startswith(("say ", "#"))]
    assert len(installs) >= 3, installs
    for i in installs:
        assert lines[i - 1].startswith("say ") and "install" in lines[i - 1], lines[i]


def test_readme_quickstart_uses_the_commands_as_they_are() -> None:
    """The simulated-replica quickstart needs no flag beyond the URLs and ports, and its client
    is pointed at the gateway (tests/test_serve_start.py runs it)."""
    text = README.read_text()
    text = text[text.index("\n## A gateway in front of a simulated replica\n") :]
    text = text[: text.index("\n## ", 1)]
    assert "prefix-router replica --port 9001\n" in text
    assert "prefix-router serve --replica http://127.0.0.1:9001 --port 8000\n" in text
    assert 'base_url="http://127.0.0.1:8000/v1"' in text
    from loadtest.sim.config import SimConfig

    assert f'model="{SimConfig().model}"' in text


def test_the_lifecycle_hook_example_is_the_whole_change(tmp_path: Path) -> None:
    """docs/scheduling.md's diff adding a hook-keeping scorer, applied as it stands: the
    schedule the page gives builds with it, keeps the lazy tail, and its count follows
    ``placed`` and ``done``."""
    import argparse

    from router.config import load_config
    from router.routing.lazy_tail import policy_allows
    from router.schedule import Decision, HashRing, from_config, registry

    text = section(DOCS / "scheduling.md", "Lifecycle hooks")
    diff = text[text.index("```diff\n") + 8 : text.index("```", text.index("```diff\n") + 8)]
    added = [line[1:] for line in diff.splitlines() if line.startswith("+") and line[:3] != "+++"]
    if "active_requests" not in registry.names("scorer"):  # registered once per process
        exec(compile("\n".join(added), "active_requests.py", "exec"), {"__name__": "example"})
    schedule = re.search(r"`(schedule: \{scorers: .*?)`", text.replace("\n", " "))
    assert schedule is not None
    path = tmp_path / "router.yaml"
    path.write_text(schedule[1])
    config = load_config(argparse.Namespace(config=str(path)), env={})
    pipeline = from_config(config.routing, HashRing(["http://a", "http://b"]))
    assert policy_allows(pipeline) is None  # the lazy tail stays on
    scorer = next(s for s, _ in pipeline.scorers if s.name == "active_requests")
    decision = Decision("http://a", 0, "prefix", pipeline.name)
    pipeline.placed(decision)
    pipeline.placed(decision)
    assert scorer.active["http://a"] == 2
    pipeline.done(decision, 200)
    assert scorer.active["http://a"] == 1
