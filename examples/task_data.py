"""Synthetic labelled data for the example tasks, generated from templates.

The data is synthetic, and says so: sentences are filled-in templates. To make the
held-out accuracy mean something, the held-out split uses templates *and* key words
(sentiment adjectives and verbs, topic entities and nouns) that never occur in
training, so a model must generalise from what the pre-trained encoder knows about
those words, not memorise strings. Pure Python and seeded: both environments (the
project's and the adapters library's) import this file and get identical data.
"""
from __future__ import annotations

import random

SENTIMENT_LABELS = ("negative", "positive")
TOPIC_LABELS = ("business", "sports", "tech")

# Each list: (train words, held-out words).
_SENTIMENT = {
    "positive": (
        ["great", "excellent", "wonderful", "fantastic", "delightful", "lovely", "brilliant", "pleasant", "superb",
         "enjoyable", "outstanding", "perfect"],
        ["amazing", "terrific", "marvelous", "splendid", "impressive", "charming"],
    ),
    "negative": (
        ["terrible", "awful", "horrible", "disappointing", "dreadful", "poor", "bad", "boring", "useless",
         "annoying", "mediocre", "unpleasant"],
        ["atrocious", "lousy", "miserable", "pathetic", "dismal", "frustrating"],
    ),
}
_SENTIMENT_VERBS = {
    "positive": (["loved", "enjoyed", "liked", "adored"], ["appreciated", "treasured"]),
    "negative": (["hated", "disliked", "regretted", "despised"], ["loathed", "resented"]),
}
_ITEMS = (
    ["movie", "restaurant", "hotel", "phone", "book", "laptop", "concert", "coffee", "service", "game"],
    ["headphones", "museum", "pizza", "camera", "flight", "sofa"],
)
_SENTIMENT_TEMPLATES = (
    ["The {item} was {adj}.", "What a {adj} {item}!", "I {verb} this {item}, it was {adj}.",
     "Honestly, the {item} felt {adj} from start to finish.", "Our {item} turned out {adj}."],
    ["My friends and I {verb} the {item}; truly {adj}.", "Overall a {adj} {item}, I {verb} it.",
     "Would I describe the {item}? In one word: {adj}."],
)

# Negations flip the label; contrasts take the label of their last clause.
_NEGATED_TEMPLATES = (
    ["The {item} was not {adj}.", "I did not find the {item} {adj} at all."],
    ["Nobody could call the {item} {adj}.", "The {item} was anything but {adj}."],
)
_CONTRAST_TEMPLATES = (
    ["The {item} looked {first} at first, but it was {adj} in the end.", "Despite a {first} start, the {item} was {adj}."],
    ["Although the {item} seemed {first}, it proved {adj}.", "They say the {item} is {first}; to me it was {adj}."],
)

_TOPICS = {
    "business": (
        {"who": ["the bank", "the retailer", "the startup", "investors", "the company", "shareholders"],
         "what": ["quarterly profits", "the merger", "interest rates", "the stock price", "sales", "the IPO"]},
        {"who": ["the central bank", "the hedge fund", "executives"],
         "what": ["inflation", "the dividend", "revenue forecasts"]},
    ),
    "sports": (
        {"who": ["the striker", "the goalkeeper", "the coach", "the home team", "the champion", "the referee"],
         "what": ["the final", "the league title", "the penalty", "the match", "the tournament", "the season"]},
        {"who": ["the sprinter", "the captain", "the tennis player"],
         "what": ["the marathon", "the world cup", "the playoffs"]},
    ),
    "tech": (
        {"who": ["the engineers", "the chipmaker", "developers", "the software firm", "the app", "researchers"],
         "what": ["the new processor", "the smartphone", "the operating system", "the update", "the AI model",
                  "the cloud platform"]},
        {"who": ["the programmers", "the robot", "the browser"],
         "what": ["the database", "the laptop battery", "machine learning"]},
    ),
}
_TOPIC_TEMPLATES = (
    ["{who} talked about {what} on Monday.", "News: {who} and {what}.", "{who} announced changes to {what}.",
     "Everyone is discussing how {who} handled {what}.", "A new report on {what} from {who}."],
    ["Late on Friday {who} commented on {what}.", "Analysts watched {who} closely after {what}.",
     "Headline: {what} surprises {who}.", "Everyone keeps asking about {what}.", "{who} made the news again."],
)


def _split(pair: tuple, held_out: bool):
    return pair[1] if held_out else pair[0]


def sentiment(n: int, held_out: bool, seed: int) -> list[tuple[str, int]]:
    """n (text, label) pairs, labels index SENTIMENT_LABELS; balanced.

    60% plain statements, 20% negated (label flipped), 20% contrasts (label of the last clause).
    """
    rng = random.Random(seed)
    data = []
    for i in range(n):
        label = i % 2
        form = rng.random()
        if form < 0.6:
            text = _sentiment_text(rng, _SENTIMENT_TEMPLATES, label, held_out)
        elif form < 0.8:
            text = _sentiment_text(rng, _NEGATED_TEMPLATES, 1 - label, held_out)
        else:
            first = rng.choice(_split(_SENTIMENT[SENTIMENT_LABELS[1 - label]], held_out))
            text = _sentiment_text(rng, _CONTRAST_TEMPLATES, label, held_out, first=first)
        data.append((text[0].upper() + text[1:], label))
    rng.shuffle(data)
    return data


def _sentiment_text(rng: random.Random, templates: tuple, polarity: int, held_out: bool, **extra: str) -> str:
    name = SENTIMENT_LABELS[polarity]
    return rng.choice(_split(templates, held_out)).format(
        item=rng.choice(_split(_ITEMS, held_out)), adj=rng.choice(_split(_SENTIMENT[name], held_out)),
        verb=rng.choice(_split(_SENTIMENT_VERBS[name], held_out)), **extra,
    )


def topic(n: int, held_out: bool, seed: int) -> list[tuple[str, int]]:
    """n (text, label) pairs, labels index TOPIC_LABELS; balanced."""
    rng = random.Random(seed)
    templates = _split(_TOPIC_TEMPLATES, held_out)
    data = []
    for i in range(n):
        label = i % 3
        words = _split(_TOPICS[TOPIC_LABELS[label]], held_out)
        text = rng.choice(templates).format(who=rng.choice(words["who"]), what=rng.choice(words["what"]))
        data.append((text[0].upper() + text[1:], label))
    rng.shuffle(data)
    return data
