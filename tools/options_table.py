"""Regenerate the README's options table from the declarations on ``apmodel.core.options.PlanOptions``.

    python tools/options_table.py           # rewrite README.md between the options-table markers
    python tools/options_table.py --check   # exit 1 if the README's table is not the generated one

``tests/test_readme.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from apmodel.core.options import with_options_table  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that the README's table is current")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = ap.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    new = with_options_table(text)
    if args.check:
        if new != text:
            print(f"{args.readme}: the options table is stale; run python tools/options_table.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.readme.write_text(new, encoding="utf-8")
        print(f"{args.readme}: options table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
