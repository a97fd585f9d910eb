"""The noise multiplier z a privacy budget allows (strategy.privacy.noise_multiplier, docs/privacy.md):
a binary search over Flower's RDP accountant, as the run accounts its rounds.

    python -m analysis.privacy_budget --epsilon 4 --rounds 20 --sample 10 --population 100
"""

from __future__ import annotations

from strategies.privacy import noise_multiplier_for


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.privacy_budget --epsilon 4 --rounds 20 --sample 10 --population 100 [--delta D]``:
    the noise multiplier z for that budget."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--epsilon", type=float, required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--sample", type=int, required=True, help="K: clients per round")
    parser.add_argument("--population", type=int, required=True, help="N: num_clients")
    parser.add_argument("--delta", type=float, default=None, help="default 1/N^1.1")
    parser.add_argument("--sampling", choices=("secret", "public"), default="secret")
    parser.add_argument("--z-only", action="store_true", help="print z alone (for a command line: "
                        "strategy.privacy.noise_multiplier=$(python -m analysis.privacy_budget ... --z-only))")
    args = parser.parse_args(argv)
    delta = args.delta if args.delta is not None else 1.0 / args.population ** 1.1
    z = noise_multiplier_for(args.epsilon, delta, args.rounds, args.sample, args.population, args.sampling)
    if args.z_only:
        print(repr(z))
        return 0
    print(f"noise_multiplier z = {z:.4f} for ε = {args.epsilon} at δ = {delta:.3g}: {args.rounds} rounds of "
          f"{args.sample} of {args.population} clients ({args.sampling} sampling)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
