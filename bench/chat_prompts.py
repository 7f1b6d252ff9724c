"""The chat profile's messages: short open questions and instructions whose answers copy nothing from them,
drawn from a seed. All of it was written for the bench, in plain ASCII."""

from __future__ import annotations

import random

TOPICS = (
    "the sea at night", "a lost umbrella", "the first day of spring", "an old train station",
    "rain on a window", "a cat asleep in the sun", "the smell of fresh bread", "a mountain lake",
    "autumn leaves",
)
ACTIVITIES = (
    "learning to cook", "running a first marathon", "growing tomatoes on a balcony", "studying for an exam",
    "keeping a houseplant alive", "learning a new language", "packing for a long trip", "sleeping better",
    "saving money each month",
)
CONCEPTS = (
    "how a rainbow forms", "why the sky is blue", "what a queue is", "how vaccines work",
    "what inflation means", "how bees make honey", "why bread rises", "how a compass works",
)
SCENES = (
    "a busy market in the morning", "a quiet library", "a beach in winter", "a small mountain village",
    "a train journey through the countryside", "a garden after the rain",
)
THINGS_TO_NAME = (
    "a pet turtle", "a small bakery", "a sailing boat", "a board game about trains", "a new coffee blend",
    "a hiking club",
)
# (template, its slot's list): each message is one template with one item of its list.
REQUESTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Write a short poem about {}.", TOPICS),
    ("Give three tips for {}.", ACTIVITIES),
    ("Explain {} in simple words.", CONCEPTS),
    ("What are the benefits of {}? Answer briefly.", ACTIVITIES),
    ("Describe {} in a few sentences.", SCENES),
    ("Suggest five names for {}.", THINGS_TO_NAME),
    ("Write a two-sentence story about {}.", TOPICS),
)


def chat_message(rng: random.Random) -> str:
    template, items = rng.choice(REQUESTS)
    return template.format(rng.choice(items))
