"""tools/mdexamples.py, and the rule it serves: every output a README shows is compared, by that
README's tests/test_readme.py, with what its example prints (issue 24)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mdexamples", ROOT / "tools" / "mdexamples.py")
assert _spec is not None and _spec.loader is not None
mdexamples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mdexamples)

README = """Intro.

```python
print("a")
```

<!-- output -->
```
a
```

```bash
echo not run
```

<!-- output -->
````
two
lines ...
````
"""


def test_examples_pair_each_code_block_with_the_output_shown_after_it() -> None:
    with pytest.raises(ValueError, match="line 18: an output block that follows no example"):
        mdexamples.examples(README)
    (ex,) = mdexamples.examples(README.split("```bash")[0])
    assert (ex.code, ex.line, ex.output, ex.output_line) == ('print("a")\n', 4, "a\n", 9)
    last = mdexamples.blocks(README)[-1]  # a fence of 4 backticks
    assert (last.lang, last.text, last.marker) == ("", "two\nlines ...\n", "output")
    assert [b.marker for b in mdexamples.blocks(README)] == [None, "output", None, "output"]


@pytest.mark.parametrize(
    ("shown", "printed"),
    [
        ("a ... c", "a b\nb c"),  # ... is any text, across lines too
        ("a\n  b", "a b\n"),  # whitespace runs are one space: README lines may be wrapped
        ("x ...", "x"),  # ... may be nothing
        ("step ...: stop (p90) [x]*", "step 24: stop (p90) [x]*"),  # the rest is literal
    ],
)
def test_what_matches(shown: str, printed: str) -> None:
    assert mdexamples.mismatch(shown, printed) is None


def test_a_mismatch_names_the_first_shown_line_not_printed() -> None:
    said = mdexamples.mismatch("a\nspread x1.20\nc", "a\nspread x1.35\nc")
    assert said is not None and said.startswith("the README shows 'spread x1.20' (shown line 2)")
    assert said.endswith("printed:\na\nspread x1.35\nc")
    said = mdexamples.mismatch("a", "a\nb")
    assert said is not None and said.startswith("the example printed more than the README shows")
    assert mdexamples.mismatch("a.c", "abc") is not None  # a dot is a dot


def readmes() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("README.md")
        if not any(part.startswith(".") or part == "node_modules" for part in p.parts)
    )


def test_every_shown_output_is_compared_by_a_test() -> None:
    checked = []
    for readme in readmes():
        text = readme.read_text()
        if not any(b.marker == mdexamples.OUTPUT for b in mdexamples.blocks(text)):
            continue
        mdexamples.examples(text)  # an output block after no example block raises
        test = readme.parent / "tests" / "test_readme.py"
        where = readme.relative_to(ROOT)
        assert test.is_file(), f"{where} shows output but no tests/test_readme.py checks it"
        assert "mdexamples.check(" in test.read_text(), f"{test} does not compare outputs"
        checked.append(str(where.parent))
    assert {"packages/slurmclock", "packages/ckptstore", "apps/train"} <= set(checked)
