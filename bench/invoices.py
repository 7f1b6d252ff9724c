"""Purchase orders drawn from a seed: the documents of the quoting profile's invoice task. Each line has a
part number (`PN-48213-B`), a name and a unit price, the figures the answer must copy; all of it plain ASCII.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from conveyor.bench.sentences import CountFn

SUPPLIERS = ("Harbor Supply Co.", "Northfield Tools Ltd.", "Bluestone Hardware", "Keller and Sons Fittings",
             "Westgate Industrial", "Pine Ridge Components", "Copperline Parts", "Ashford Fasteners")
MATERIALS = ("steel", "brass", "nylon", "aluminium", "copper", "zinc-plated", "stainless", "rubber")
PARTS = ("hex bolt", "flat washer", "door hinge", "angle bracket", "ball valve", "pipe clamp", "wing nut",
         "compression spring", "ball bearing", "flange gasket", "cable tie", "wall anchor", "socket screw",
         "pulley wheel", "hose fitting", "lock nut")
SIZES = ("M6 x 20", "M8 x 40", "12 mm", "3/8 in", "25 mm", "1/2 in", "M10 x 60", "40 mm", "6 mm", "3/4 in")


@dataclass(frozen=True)
class OrderLine:
    part_number: str  # PN-NNNNN-L
    name: str
    quantity: int
    unit_price: str  # "$12.50", as printed

    def text(self, n: int) -> str:
        return f"{n:>2}. {self.part_number}  {self.name}  qty {self.quantity}  unit price {self.unit_price}"


@dataclass(frozen=True)
class Order:
    text: str
    lines: tuple[OrderLine, ...]


def order(rng: random.Random, num_tokens: int, count: CountFn) -> Order:
    """A purchase order whose lines hold at least `num_tokens` tokens (and at least two lines)."""
    head = [f"PURCHASE ORDER PO-{rng.randint(100000, 999999)}", f"Supplier: {rng.choice(SUPPLIERS)}",
            f"Date: 2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", ""]
    lines: list[OrderLine] = []
    total = sum(count(h + "\n") for h in head)
    while total < num_tokens or len(lines) < 2:
        lines.append(_line(rng, {line.part_number for line in lines}))
        total += count(lines[-1].text(len(lines)) + "\n")
    body = [line.text(n) for n, line in enumerate(lines, start=1)]
    cents = sum(line.quantity * _cents(line.unit_price) for line in lines)
    text = "\n".join([*head, *body, "", f"Total: ${cents // 100}.{cents % 100:02d}"])
    return Order(text, tuple(lines))


def _line(rng: random.Random, taken: set[str]) -> OrderLine:
    number = _part_number(rng)
    while number in taken:  # each part once per order: an answer lists each number once
        number = _part_number(rng)
    name = f"{rng.choice(MATERIALS)} {rng.choice(PARTS)}, {rng.choice(SIZES)}"
    cents = rng.randint(5, 99999)
    return OrderLine(number, name, rng.randint(1, 60), f"${cents // 100}.{cents % 100:02d}")


def _part_number(rng: random.Random) -> str:
    return f"PN-{rng.randint(10000, 99999)}-{rng.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}"


def _cents(price: str) -> int:
    dollars, _, cents = price.removeprefix("$").partition(".")
    return int(dollars) * 100 + int(cents)
