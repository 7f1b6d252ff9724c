"""Ordinary English sentences drawn from a seeded vocabulary: the paragraphs of the quoting profile's rewrite
and summary tasks. Every sentence is one of the templates below with its slots filled from the lists below;
all of it was written for the bench, in plain ASCII.

Every template names a THING, so a paragraph always holds a word the rewrite task can ask to replace; no
template writes a THING in the plural or inside a longer word, so replacing it is a whole-word edit.
"""

from __future__ import annotations

import random
from collections.abc import Callable

CountFn = Callable[[str], int]  # tokens in a piece of text, without special tokens

NAMES = ("Anna", "Tomas", "Priya", "Kenji", "Lucia", "Omar", "Greta", "Samuel", "Ines", "Viktor", "Maya",
         "Daniel", "Nadia", "Felix")
PLACES = ("the harbour", "the old mill", "the library", "the market square", "the train station",
          "the village school", "the riverside park", "the bakery on the corner", "the town hall",
          "the museum", "the post office", "the hill above the farm")
THINGS = ("lantern", "bicycle", "notebook", "umbrella", "kettle", "ladder", "basket", "compass", "blanket",
          "clock", "window", "bridge", "letter", "boat", "map", "piano", "fence", "wagon")
TIMES = ("early in the morning", "after lunch", "late in the evening", "on Sunday", "before the storm",
         "at the end of the week", "during the festival", "in the spring", "on a rainy afternoon")
ADJECTIVES = ("quiet", "bright", "heavy", "narrow", "old", "wooden", "careful", "crowded", "small", "green",
              "cold", "plain")
TEMPLATES = (
    "{name} carried the {adj} {thing} to {place} {time}.",
    "Nobody at {place} had seen a {thing} quite so {adj} before.",
    "{Time}, {name} repaired the {thing} with a piece of string and a little patience.",
    "The {thing} near {place} looked {adj}, so {name} decided to leave it where it was.",
    "{name} wrote a long note about the {thing} and left it at {place} {time}.",
    "When the {thing} stopped working, {name} asked a neighbour from {place} for help.",
    "People who walk past {place} often stop to look at the {adj} {thing}.",
    "{name} believed that every {thing} has a story, even the {adj} ones.",
    "The children found a {thing} behind {place} and brought it home {time}.",
    "It took {name} three days to paint the {adj} {thing} a pale shade of blue.",
    "{Time}, the {thing} at {place} was moved to make room for a new one.",
    "According to {name}, the {thing} had belonged to a sailor who once lived by {place}.",
    "{name} laughed when the {adj} {thing} fell over in the wind {time}.",
    "A small sign next to the {thing} at {place} asked visitors not to touch it.",
    "{name} measured the {thing} twice and wrote the numbers on the back of an envelope.",
    "By the time {name} reached {place}, the {thing} had already been sold.",
)


def sentence(rng: random.Random) -> str:
    """One sentence: a template with its slots drawn from `rng`."""
    time = rng.choice(TIMES)
    return rng.choice(TEMPLATES).format(
        name=rng.choice(NAMES), place=rng.choice(PLACES), thing=rng.choice(THINGS), time=time,
        Time=time[0].upper() + time[1:], adj=rng.choice(ADJECTIVES),
    )


def sentences(rng: random.Random, num_tokens: int, count: CountFn, least: int = 2) -> list[str]:
    """Sentences until they hold at least `num_tokens` tokens (each counted with its leading space), and at
    least `least` of them."""
    out: list[str] = []
    total = 0
    while total < num_tokens or len(out) < least:
        out.append(sentence(rng))
        total += count(" " + out[-1])
    return out
