"""The bundled model's training corpus: simple stories written from templates, seeded and reproducible.

The stories use a small vocabulary and a handful of plots (a lost toy, a present for someone, a fear
overcome, a rainy day, sharing), with a hero, a friend and objects drawn at random. Each story keeps
its characters and objects from start to end, so a model that learns the corpus writes text that
stays on topic: the name and the object of the first sentence come back in the last.

    python scripts/make_corpus.py --stories 5 --seed 1      # print five stories

``make_stories(count, seed)`` is what ``scripts/train_tiny_model.py`` and the held-out loss test use.
Training uses seed 0; the held-out set uses seed 1 (different draws from the same templates).
"""

from __future__ import annotations

import argparse
import random

# Names and kinds are drawn independently, so the model must copy the name from the prompt rather
# than guess it from the kind ("a little fox named ..." can be anyone).
SHE_NAMES = ["Lily", "Mia", "Anna", "Lucy", "Zoe", "Emma", "Rosa", "Nina", "Sara", "Ella", "Ruby", "Daisy",
             "Molly", "Kate", "Ivy", "Luna", "Amy", "Grace", "Hanna", "Julia", "Maya", "Nora", "Olive", "Pia"]
HE_NAMES = ["Tom", "Ben", "Sam", "Max", "Tim", "Leo", "Jack", "Finn", "Noah", "Luke", "Oscar", "Jake",
            "Adam", "Eli", "Hugo", "Ivan", "Kai", "Liam", "Milo", "Otto", "Paul", "Ray", "Theo", "Vince"]
KINDS = ["small cat", "brown dog", "tiny bird", "happy frog", "young fox", "little bear", "white rabbit",
         "little duck", "little lion", "gray mouse", "small fish", "little owl", "baby elephant", "small turtle",
         "little pig", "young deer"]
CHILD_KINDS = {"she": ["little girl", "kind girl"], "he": ["little boy", "funny boy"]}


def _hero(rng: random.Random) -> tuple[str, str, str]:
    """(name, pronoun, kind): a child of the name's gender, or an animal."""
    pron = rng.choice(["she", "he"])
    name = rng.choice(SHE_NAMES if pron == "she" else HE_NAMES)
    kind = rng.choice(CHILD_KINDS[pron]) if rng.random() < 0.3 else rng.choice(KINDS)
    return name, pron, kind


PLACES = [
    "a small house near the woods", "a big farm", "a quiet village", "a little town by the sea",
    "a green forest", "a house with a red door", "a cozy home on a hill", "a busy city",
]
TOYS = [
    "red ball", "blue kite", "little boat", "old teddy bear", "yellow hat", "shiny car",
    "toy train", "green box", "soft blanket", "big drum", "pink doll", "wooden horse",
]
HIDING_SPOTS = [
    "under the bed", "behind the big tree", "in the tall grass", "next to the pond",
    "inside an old box", "under a pile of leaves", "by the garden gate", "on top of the shelf",
]
PLAY_SPOTS = ["garden", "park", "yard", "living room", "field", "forest"]
FEELINGS_SAD = ["sad", "very sad", "upset", "worried"]
FEELINGS_HAPPY = ["happy", "very happy", "so glad", "full of joy"]
GIFTS = [
    ("card", "paper and colors"), ("cake", "flour, eggs and sugar"), ("necklace", "small beads"),
    ("picture", "paint and a brush"), ("hat", "soft yarn"), ("basket", "long grass"),
]
RECIPIENT_PRONOUN = {"mom": "she", "dad": "he", "grandma": "she", "grandpa": "he", "sister": "she", "brother": "he"}
RECIPIENTS = list(RECIPIENT_PRONOUN)
FEARS = [
    ("the dark", "turned off the light", "the stars outside were bright and kind"),
    ("the big slide", "climbed to the top", "going down was fast and fun"),
    ("the deep water", "put one foot in the lake", "the water was cool and calm"),
    ("the loud thunder", "heard a big boom", "the storm could not hurt anyone in the warm house"),
    ("the new school", "walked through the door", "the other children were friendly"),
]
RAINY_GAMES = [
    "built a fort with pillows", "drew pictures of animals", "played a game with cards",
    "baked cookies", "read a book about the moon", "made a puppet show",
]
FRUITS = ["apples", "cookies", "grapes", "berries", "sweets", "oranges"]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _poss(pronoun: str) -> str:
    return "his" if pronoun == "he" else "her"


def _opening(rng: random.Random, name: str, kind: str, place: str) -> str:
    start = rng.choice(["Once upon a time, there was", "One day, there was", "Long ago, there was"])
    return f"{start} {_article(kind)} {kind} named {name}. {name} lived in {place}."


def _lost_toy(rng, name, pron, kind, friend, place):
    toy, spot, play = rng.choice(TOYS), rng.choice(HIDING_SPOTS), rng.choice(PLAY_SPOTS)
    first, second = rng.sample([s for s in HIDING_SPOTS if s != spot], 2)
    cap = pron.capitalize()
    return " ".join([
        _opening(rng, name, kind, place),
        f"{name} had {_article(toy)} {toy} that {pron} loved very much.",
        f"Every day, {pron} played with the {toy} in the {play}.",
        f"One morning, the {toy} was gone!",
        f"{name} looked {first} and {second}, but {pron} could not find it.",
        f"{cap} felt {rng.choice(FEELINGS_SAD)}.",
        f"Then {friend} came by and asked, \"Why are you sad, {name}?\"",
        f"\"I lost my {toy},\" said {name}.",
        f"\"I will help you,\" said {friend}.",
        f"They looked together, and at last {friend} found the {toy} {spot}.",
        f"{name} was {rng.choice(FEELINGS_HAPPY)}. \"Thank you, {friend}!\" {pron} said.",
        f"From that day on, {name} and {friend} played with the {toy} together.",
    ])


def _gift(rng, name, pron, kind, friend, place):
    (gift, stuff), who = rng.choice(GIFTS), rng.choice(RECIPIENTS)
    cap = pron.capitalize()
    return " ".join([
        _opening(rng, name, kind, place),
        f"Soon it was the birthday of {name}'s {who}.",
        f"{name} wanted to make a {gift} for {_poss(pron)} {who}.",
        f"{cap} found {stuff} and started to work.",
        f"It was hard, and the first {gift} did not look good.",
        f"{name} did not give up. {cap} tried again, slowly and carefully.",
        f"{friend} came to help, and together they made the {gift} pretty.",
        f"When {_poss(pron)} {who} saw the {gift}, {RECIPIENT_PRONOUN[who]} smiled and gave {name} a big hug.",
        f"\"This is the best {gift} ever,\" said {_poss(pron)} {who}.",
        f"{name} felt proud, and {pron} learned that trying again is worth it.",
    ])


def _fear(rng, name, pron, kind, friend, place):
    fear, action, lesson = rng.choice(FEARS)
    cap = pron.capitalize()
    return " ".join([
        _opening(rng, name, kind, place),
        f"{name} was afraid of {fear}.",
        f"Every time {pron} thought about {fear}, {pron} wanted to hide.",
        f"One day, {friend} said, \"Do not be scared, {name}. I will stay with you.\"",
        f"{name} took a deep breath and {action}.",
        f"{cap} held {friend}'s hand and waited.",
        f"Soon {name} saw that {lesson}.",
        f"\"I am not afraid of {fear} anymore!\" said {name}.",
        f"{friend} smiled, and {name} felt brave and {rng.choice(FEELINGS_HAPPY)}.",
    ])


def _rainy_day(rng, name, pron, kind, friend, place):
    game_a, game_b = rng.sample(RAINY_GAMES, 2)
    play = rng.choice(PLAY_SPOTS)
    cap = pron.capitalize()
    return " ".join([
        _opening(rng, name, kind, place),
        f"{name} wanted to play in the {play} with {friend}.",
        f"But when {pron} looked out of the window, it was raining.",
        f"{cap} felt {rng.choice(FEELINGS_SAD)}. \"Now we cannot play,\" said {name}.",
        f"\"We can play inside,\" said {friend}.",
        f"So {name} and {friend} {game_a}.",
        f"Then they {game_b}.",
        "They laughed and had a lot of fun.",
        f"When the rain stopped, the sun came out and they ran to the {play}.",
        f"{name} said, \"Rainy days can be fun too!\"",
    ])


def _sharing(rng, name, pron, kind, friend, place):
    food, count = rng.choice(FRUITS), rng.choice(["three", "four", "five", "six"])
    cap = pron.capitalize()
    return " ".join([
        _opening(rng, name, kind, place),
        f"One day, {name} had {count} {food} in a little basket.",
        f"{cap} wanted to eat all the {food} alone.",
        f"Then {name} saw {friend} sitting under a tree. {friend} looked hungry.",
        f"{name} thought for a moment.",
        f"Then {pron} walked to {friend} and said, \"Do you want some {food}?\"",
        f"{friend} was {rng.choice(FEELINGS_HAPPY)}. \"Yes, please!\" said {friend}.",
        f"They sat together and shared the {food}.",
        f"The {food} tasted even better with a friend.",
        f"{name} learned that sharing makes everyone happy.",
    ])


PLOTS = [_lost_toy, _gift, _fear, _rainy_day, _sharing]


def make_story(rng: random.Random) -> str:
    """One story: a hero, a different friend, a place and a plot, all drawn from ``rng``."""
    name, pron, kind = _hero(rng)
    friend = rng.choice([n for n in SHE_NAMES + HE_NAMES if n != name])
    return rng.choice(PLOTS)(rng, name, pron, kind, friend, rng.choice(PLACES))


def make_stories(count: int, seed: int) -> list[str]:
    """``count`` stories drawn with ``random.Random(seed)``: the same seed gives the same list."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    rng = random.Random(seed)
    return [make_story(rng) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stories", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for story in make_stories(args.stories, args.seed):
        print(story, end="\n\n")


if __name__ == "__main__":
    main()
