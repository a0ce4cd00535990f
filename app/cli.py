"""The `manyeyes` command line."""

from __future__ import annotations

import argparse
import sys

from model.errors import ModelLoadError, TooLongError

SHADES = " .:-=+*#%@"  # ten steps, light to dark


def _format_head(tokens: list[str], weights, width: int = 12) -> str:
    """A readable matrix: rows are queries, columns keys, values to 2 decimals plus a shade."""
    labels = [t if len(t) <= width else t[: width - 1] + "…" for t in tokens]
    pad = max(len(lab) for lab in labels)
    lines = [" " * (pad + 2) + " ".join(f"{i:>5}" for i in range(len(tokens)))]
    for i, (lab, row) in enumerate(zip(labels, weights.tolist())):
        cells = " ".join(f"{v:5.2f}" for v in row)
        shade = "".join(SHADES[min(int(v * len(SHADES)), len(SHADES) - 1)] for v in row)
        lines.append(f"{lab:>{pad}} {i:>1} {cells}  |{shade}|")
    return "\n".join(lines)


def cmd_attend(args) -> int:
    from model import load

    model = load(args.model, device=args.device)
    info = model.info
    if not 0 <= args.layer < info.n_layers or not 0 <= args.head < info.n_heads:
        print(f"error: layer must be in 0..{info.n_layers - 1} and head in 0..{info.n_heads - 1}", file=sys.stderr)
        return 2
    result = model.attend(args.text, args.pair, truncate=args.truncate)
    texts = [t.text for t in result.tokens]
    print(f"model {info.id} ({info.family}, {'causal' if info.causal else 'bidirectional'}, "
          f"{info.n_layers} layers x {info.n_heads} heads) on {info.device}")
    print(f"{len(texts)} tokens{' (truncated)' if result.truncated else ''}:")
    print("  " + " ".join(f"[{i}]{t}" for i, t in enumerate(texts)))
    print(f"\nlayer {args.layer}, head {args.head} (rows: queries, columns: keys)")
    print(_format_head(texts, result.attention[args.layer, args.head]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="manyeyes", description="See what every attention head does.")
    sub = parser.add_subparsers(dest="command", required=True)

    attend = sub.add_parser("attend", help="print the attention of one head for a sentence")
    attend.add_argument("text")
    attend.add_argument("--pair", default=None, help="optional second sentence (pair models)")
    attend.add_argument("--model", default="minilm", help="built-in name, HF folder or book .pth (default: minilm)")
    attend.add_argument("--layer", type=int, default=0)
    attend.add_argument("--head", type=int, default=0)
    attend.add_argument("--truncate", action="store_true", help="cut input longer than the model's positions")
    attend.add_argument("--device", default=None, help="cpu, cuda, mps (default: best available)")
    attend.set_defaults(func=cmd_attend)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, TooLongError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
