"""Plot training and validation loss from a pretrain_gpt.py log: ``--log LOG --output PNG``."""

import argparse
import re
import sys

TRAIN_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.Ee+-]+) \|")
VALID_RE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.Ee+-]+)")


def read_losses(path):
    """(iteration, loss) pairs of training and validation, in iteration order.

    A log that several runs appended to (a run resumed from a checkpoint) may repeat
    iterations; the latest line of an iteration wins.
    """
    train, valid = {}, {}
    with open(path, errors="replace") as f:
        for line in f:
            m = TRAIN_RE.search(line)
            if m:
                train[int(m.group(1))] = float(m.group(2))
            m = VALID_RE.search(line)
            if m:
                valid[int(m.group(1))] = float(m.group(2))
    return sorted(train.items()), sorted(valid.items())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--log", required=True)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    train, valid = read_losses(args.log)
    if not train:
        print(f"{args.log}: no 'iteration N/ M | ... | lm loss: X |' lines found", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train), label="train lm loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"loss curve: {args.output} ({len(train)} train points, {len(valid)} validation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
