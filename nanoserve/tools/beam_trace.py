"""See a beam search share its KV blocks: the fork, free and copy-on-write dance of one
`LLM.beam_search`, step by step, from the step records of `LLM(..., trace=True)` (their
`block_tables` and `blocks_copied`).

    python -m nanoserve.tools.beam_trace [--model PATH] [--prompt TEXT] [--beam-width 3]
        [--max-tokens 8] [--out DIR]

runs one search with blocks of 4 tokens on the CPU and writes beam.txt (per step: each beam's block
table, the blocks several beams hold, the copies, who forked and who was freed) and beam_blocks.png
(a panel per step: a row per beam, its blocks left to right, coloured by how many beams hold them).
docs/beam_search.md shows it. In Python: `plot_beam_blocks(llm.trace, "b.png", block_size)`,
`format_beam_trace(llm.trace)`.
"""
import argparse
import os
from collections import Counter
from dataclasses import dataclass
from string import ascii_uppercase

# a bare Figure draws with Agg: no GUI backend, no pyplot state
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from nanoserve import LLM, BeamSearchParams
from nanoserve.step_records import StepRecord

HOLDERS = ["#f0f0f0", "#9ecae1", "#4292c6", "#08519c", "#08306b"]  # held by 1, 2, 3, 4, 5+ beams
COPY = "#e69f00"  # a block copy-on-write filled this step (Okabe-Ito orange)


@dataclass
class BeamStep:
    """One step of the search as the pictures show it."""

    step: int
    kind: str
    # beam name -> its KV blocks after the step, siblings next to each other
    tables: dict[str, list[int]]
    holders: Counter  # block id -> how many beams hold it
    copies: list[tuple[int, int]]  # copy-on-write before the step's forward: (source, destination)
    forks: list[tuple[str, str]]  # (child, parent): the child shares every block of its parent
    # beams without a child (or done): their blocks went back, unless another beam holds them
    freed: list[str]
    # tokens in each beam's KV after the step (a search's beams all have the same length)
    num_tokens: int

    def events(self) -> list[str]:
        forks = [f"{child} forks from {parent}" for child, parent in self.forks]
        return forks + [f"{b} freed" for b in self.freed]


def beam_steps(trace: list[StepRecord]) -> list[BeamStep]:
    """The records read as a beam search's steps (one request in the trace); beams are named A, B,
    C... in the order they appear. Who forked from whom and who was dropped come from the records
    (`forked`, `dropped`)."""
    names: dict[int, str] = {}
    steps = []
    for rec in trace:
        for seq_id in sorted(rec.block_tables):
            names.setdefault(seq_id, ascii_uppercase[len(names) % 26])
        tables = {names[s]: t for s, t in rec.block_tables.items()}
        steps.append(BeamStep(step=rec.step, kind=rec.kind, tables=tables,
                              holders=Counter(b for t in tables.values() for b in t),
                              copies=rec.blocks_copied,
                              forks=[(names[child], names[parent]) for child, parent in rec.forked],
                              freed=[names[s] for s in rec.dropped],
                              num_tokens=max((r.start + r.num_tokens for r in rec.scheduled),
                                             default=0)))
    return steps


def format_beam_trace(trace: list[StepRecord]) -> str:
    lines = [f"{'step':>4}  {'kind':<7}  {'beams: block tables':<34}  {'shared (holders)':<18}  "
             f"{'copies':<12}  events"]
    for s in beam_steps(trace):
        tables = " ".join(f"{name}:[{' '.join(map(str, t))}]"
                          for name, t in s.tables.items()) or "-"
        shared = " ".join(f"{b}:{n}" for b, n in sorted(s.holders.items()) if n > 1) or "-"
        copies = " ".join(f"{a}->{b}" for a, b in s.copies) or "-"
        events = ", ".join(s.events())
        row = f"{s.step:>4}  {s.kind:<7}  {tables:<34}  {shared:<18}  {copies:<12}  {events}"
        lines.append(row.rstrip())
    return "\n".join(lines)


def plot_beam_blocks(trace: list[StepRecord], path: str, block_size: int, title: str = "",
                     columns: int = 4) -> None:
    """A panel per step: a row per live beam, its KV blocks left to right (the block id in each),
    coloured by how many beams hold the block; the last block's filled part shows how many of its
    slots hold tokens. An orange frame: the block copy-on-write made this step. Under each panel:
    forks, frees, copies."""
    steps = beam_steps(trace)
    num_rows = -(-len(steps) // columns)
    most_beams = max((len(s.tables) for s in steps), default=1)
    most_blocks = max((len(t) for s in steps for t in s.tables.values()), default=1)
    fig = Figure(figsize=(3.4 * columns, num_rows * (0.42 * most_beams + 1.5) + 0.9), dpi=110,
                 layout="constrained")
    axes = fig.subplots(num_rows, columns, squeeze=False).flatten()
    for ax, s in zip(axes, steps):
        for y, table in enumerate(s.tables.values()):
            for x, block in enumerate(table):
                # the last block may be partial
                fill = min(block_size, s.num_tokens - x * block_size) / block_size
                colour = HOLDERS[min(s.holders[block], len(HOLDERS)) - 1]
                ax.add_patch(Rectangle((x, y), fill, 0.8, facecolor=colour, edgecolor="none"))
                copied = any(block == dst for _, dst in s.copies)
                ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor="none",
                                       edgecolor=COPY if copied else "#777777",
                                       linewidth=2.2 if copied else 0.8))
                dark = s.holders[block] >= 3 and fill == 1
                ax.text(x + 0.5, y + 0.4, str(block), ha="center", va="center", fontsize=10,
                        fontweight="bold", color="white" if dark else "black")
        ax.set_xlim(-0.05, most_blocks + 0.05)
        ax.set_ylim(most_beams - 0.1, -0.1)
        ax.set_yticks([y + 0.4 for y in range(len(s.tables))], list(s.tables), fontsize=9)
        ax.set_xticks([])
        for side in ("top", "right", "bottom", "left"):
            ax.spines[side].set_visible(False)
        ax.set_title(f"step {s.step} ({s.kind}): {s.num_tokens} tokens in KV", fontsize=9)
        events = s.events() + [f"copy {a}\u2192{b}" for a, b in s.copies]
        if not s.tables:
            ax.text(0, 0.5, "search done:\nevery beam's blocks freed", fontsize=9, va="center")
        ax.set_xlabel("; ".join(events), fontsize=8.5)
    for ax in axes[len(steps):]:
        ax.set_visible(False)
    handles = [Patch(facecolor=c, edgecolor="#777777",
                     label=f"held by {i + 1}{'+' if i == len(HOLDERS) - 1 else ''} "
                           f"beam{'s' if i else ''}")
               for i, c in enumerate(HOLDERS[:max(2, min(most_beams, 5))])]
    handles.append(Patch(facecolor="white", edgecolor="#777777",
                         label="free slots of a partly filled block"))
    handles.append(Patch(facecolor="white", edgecolor=COPY, linewidth=2.2,
                         label="copy-on-write this step (a shared block's copy, for the beam that "
                               "writes it)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8.5, frameon=False)
    fig.suptitle(title or "which beams share which KV blocks after each step", fontsize=10)
    fig.savefig(path)


DEFAULT_OUT = "trace-out"  # in .gitignore: a run in the repository leaves nothing to commit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a model folder or hub id (default: the embedded model)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--beam-width", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for beam.txt, beam_blocks.png (default: "
                        f"{DEFAULT_OUT}, which git ignores)")
    args = parser.parse_args(argv)
    llm = LLM(args.model, trace=True, block_size=4, max_model_len=128, device="cpu",
              enable_beam_search=True)
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens)
    out = llm.beam_search([args.prompt], params, use_tqdm=False)[0]
    title = (f"beam search, width {args.beam_width}, on {args.prompt!r} "
             f"({len(out.prompt_token_ids)} tokens), blocks of 4 tokens: which beams share which "
             "KV blocks after each step")
    table = format_beam_trace(llm.trace)
    print(title, table, "", *(f"{c.cumulative_logprob:8.3f}  {c.text!r}" for c in out.outputs),
          sep="\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "beam.txt"), "w") as f:
        f.write(table + "\n")
    plot_beam_blocks(llm.trace, os.path.join(args.out, "beam_blocks.png"), block_size=4,
                     title=title)
    print(f"wrote {args.out}/beam.txt, {args.out}/beam_blocks.png")


if __name__ == "__main__":
    main()
