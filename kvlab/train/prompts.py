"""The training prompts: a topic list × a few instruction styles, written by the project.
Reads the evaluation and calibration prompt files; :func:`write_train_prompts` alone writes
``data/train_prompts.jsonl``.

``python -m kvlab train-student`` trains on ``data/train_prompts.jsonl``, which
:func:`write_train_prompts` builds from :data:`QUESTIONS` × :data:`STYLES` and :data:`TASKS`.
Evaluation prompts (``data/prompts.jsonl``) and calibration prompts (``data/calibration.jsonl``) never
enter training: every candidate whose content words overlap an evaluation/calibration prompt's by
``near_duplicate`` is dropped (and ``tests/test_train.py`` checks the committed file).
"""
from __future__ import annotations

import json
import re
from difflib import SequenceMatcher
from pathlib import Path

# Subjects deliberately different from the evaluation/calibration prompts' subjects.
QUESTIONS = [
    "why the sky is blue during the day but red and orange at sunset",
    "how rainbows form after a storm",
    "why ice floats on water instead of sinking",
    "how a magnet attracts iron but not wood or plastic",
    "why hot air balloons rise",
    "how a lever lets a small child lift a heavy adult on a seesaw",
    "why a spoon in a glass of water looks bent",
    "how thermometers measure temperature",
    "why metal feels colder than wood at the same temperature",
    "how a pendulum clock keeps time",
    "why we see lightning before we hear thunder",
    "how mirrors reflect an image",
    "why bicycles are easier to balance when they are moving",
    "how a compass always points north",
    "why water boils at a lower temperature on top of a mountain",
    "how clouds form and why some clouds bring rain",
    "why snowflakes have six sides",
    "how wind is created",
    "how hurricanes form over warm oceans",
    "why deserts get so cold at night",
    "how rivers carve canyons over millions of years",
    "how fossils are made",
    "why mountains are cold even though they are closer to the sun",
    "how glaciers move",
    "why some beaches have black sand",
    "how caves and stalactites form",
    "how bees make honey",
    "why zebras have stripes",
    "how fish breathe underwater",
    "why dogs wag their tails",
    "how chameleons change colour",
    "why some animals hibernate in winter",
    "how ants find their way back to the nest",
    "why owls can turn their heads so far",
    "how spiders spin webs without getting stuck",
    "why whales are mammals and not fish",
    "how octopuses use their arms",
    "why giraffes have such long necks",
    "how fireflies make light",
    "why trees grow rings every year",
    "how seeds know which way to grow",
    "why cactus plants can live in the desert",
    "how mushrooms grow and what they eat",
    "why flowers smell nice",
    "how our eyes see colours",
    "why we yawn",
    "how bones heal after a break",
    "why we get goosebumps",
    "how the lungs get oxygen into the blood",
    "why we have fingerprints",
    "how the stomach digests food",
    "why we get hiccups",
    "how muscles get stronger with exercise",
    "why our voices sound different on a recording",
    "how the ear keeps us balanced",
    "why we sneeze",
    "how teeth grow and why we lose baby teeth",
    "why some people are left-handed",
    "how a camera captures a photo",
    "how a car engine turns fuel into motion",
    "how an elevator works",
    "how a battery stores energy",
    "how solar panels turn sunlight into electricity",
    "how a wind turbine makes power",
    "how a submarine dives and surfaces",
    "how a helicopter flies",
    "how traffic lights know when to change",
    "how a barcode scanner reads prices",
    "how a 3D printer builds objects",
    "how email gets delivered",
    "how a search engine finds web pages",
    "how a video game draws moving pictures",
    "how a calculator adds numbers",
    "how a thermostat keeps a house warm",
    "how a dishwasher cleans plates",
    "how a vending machine knows which coin you put in",
    "how the post office sorts millions of letters",
    "how a city gets clean water to every tap",
    "how recycling plants separate plastic, paper and metal",
    "how a library decides where to put each book",
    "how elections count millions of votes",
    "how a jury decides a court case",
    "why people pay taxes and what taxes pay for",
    "how a small business sets its prices",
    "why some jobs pay more than others",
    "how insurance works",
    "how the ancient Greeks held the first Olympic games",
    "how the Vikings sailed across the Atlantic",
    "how the Silk Road connected distant civilizations",
    "how castles were defended in the Middle Ages",
    "how the ancient Egyptians made paper from papyrus",
    "how explorers navigated the oceans before satellites",
    "how the first airplanes were invented",
    "how the telephone changed the way people talk",
    "how people kept food cold before electricity existed",
    "how the alphabet was invented",
    "how maps of the whole world were first drawn",
    "why the Great Wall of China was built",
    "how ancient farmers first grew crops",
    "how coins and paper money were invented",
    "how the planets got their names",
    "why Mars is red",
    "how comets get their tails",
    "why Saturn has rings",
    "how astronauts eat and sleep in space",
    "why the Sun will not burn forever",
    "how telescopes see things far away",
    "why there is no sound in space",
    "how shooting stars happen",
    "how the Moon causes ocean tides",
    "why some numbers are called odd and some even",
    "how fractions work",
    "why a triangle's angles add up to 180 degrees",
    "how negative numbers work",
    "how percentages are calculated",
    "why shuffling a deck of cards makes a new order almost every time",
    "how musical notes are written down",
    "why some songs sound happy and others sad",
    "how an orchestra stays together without talking",
    "how paint colours mix",
    "how animated movies are made",
    "how a bicycle's gears make hills easier",
    "how chess players plan many moves ahead",
    "why popcorn pops",
    "why cheese has holes",
    "how chocolate is made from cacao beans",
    "why chopped apples turn brown",
    "how ice cream is made",
    "why milk goes sour",
    "how pasta is made",
]

STYLES = [
    "ELI5: {q}? Explain it simply, step by step.",
    "Explain like I'm five {q}, with an everyday example.",
    "Can you explain {q}? Keep it short and clear for a curious ten-year-old.",
    "Write a short, friendly paragraph explaining {q}.",
]

TASKS = [
    "Write a short story about a {x}.",
    "Give step-by-step instructions for {y}.",
    "Write a short poem about {z}, then explain what it means.",
]
TASK_FILL = {
    "x": ["dragon who is afraid of the dark", "girl who finds a map inside an old book", "robot gardener on Mars",
          "cat who runs a bakery", "boy who can talk to the wind", "lost penguin in a big city",
          "time-travelling bicycle", "tiny mouse who wants to be a sailor", "tree that remembers everyone who "
          "sat under it", "friendly ghost in a school library", "young inventor who builds a flying umbrella",
          "family of otters preparing for winter", "shy giant who loves to knit", "detective snail",
          "kite that escapes into the clouds", "pair of shoes that walk on their own"],
    "y": ["making a paper airplane that flies far", "brewing a good cup of tea", "packing a suitcase for a week-long "
          "trip", "building a simple birdhouse", "washing a dog", "making a paper boat", "cleaning a messy bedroom "
          "quickly", "learning to juggle three balls", "setting up a fish tank", "making pancakes from scratch",
          "writing a thank-you note", "preparing for a job interview", "starting a morning running habit",
          "organising a birthday party for a child", "repotting a house plant", "making a budget for a month"],
    "z": ["a thunderstorm at night", "the smell of the sea", "a quiet library", "a busy train station",
          "the first day of spring", "an old friendship", "a cup of hot cocoa", "the city at midnight",
          "a mountain sunrise", "a lost umbrella", "a garden after rain", "the last day of summer holidays",
          "a cat sleeping in the sun", "learning something new", "a long road trip", "falling leaves in the park"],
}

_STOP = set("""a an the and or but of to in on at for with by from as is are was were be been being it its this that
these those i you he she we they me my your our their what why how when where which who whom do does did can could
would should will shall may might must not no so if then than too very just also about into over under up down out
there here some any all each every more most other such only own same few many much explain like five eli5 im i'm
step simply example everyday keep short clear curious ten year old write friendly paragraph them actually""".split())


def content_words(text: str) -> set[str]:
    """Lower-case words of ``text`` minus stop words and the instruction templates' own words."""
    return {w for w in re.findall(r"[a-z']+", text.lower()) if w not in _STOP and len(w) > 2}


def near_duplicate(a: str, b: str, jaccard: float = 0.5, ratio: float = 0.8) -> bool:
    """True if ``a`` and ``b`` share ≥ ``jaccard`` of their content words, or their lower-cased texts
    match with ``SequenceMatcher`` ratio ≥ ``ratio``."""
    wa, wb = content_words(a), content_words(b)
    if wa and wb and len(wa & wb) / len(wa | wb) >= jaccard:
        return True
    return SequenceMatcher(None, a.lower(), b.lower()).ratio() >= ratio


def candidate_prompts() -> list[dict]:
    """Every question in every style, then every task filled in: ``{"id", "prompt", "kind"}`` rows."""
    rows = []
    for qi, q in enumerate(QUESTIONS):
        for si, style in enumerate(STYLES):
            rows.append({"id": f"train-q{qi:03d}-s{si}", "prompt": style.format(q=q), "kind": "explain"})
    for ti, task in enumerate(TASKS):
        key = "xyz"[ti]
        for fi, fill in enumerate(TASK_FILL[key]):
            rows.append({"id": f"train-t{ti}-{fi:02d}", "prompt": task.format(**{key: fill}), "kind": "task"})
    return rows


def build_train_prompts(exclude: list[str]) -> list[dict]:
    """:func:`candidate_prompts` minus every near-duplicate of a prompt in ``exclude``."""
    return [r for r in candidate_prompts() if not any(near_duplicate(r["prompt"], e) for e in exclude)]


def train_prompts_file() -> Path:
    from kvlab.core.data import DATA_DIR

    return DATA_DIR / "train_prompts.jsonl"


def excluded_prompts() -> list[str]:
    """The evaluation and calibration prompts: never trained on."""
    from kvlab.core.data import calibration_file, load_prompts, prompts_file

    return [r["prompt"] for f in (prompts_file(), calibration_file()) for r in load_prompts(f)]


def write_train_prompts(path: Path | None = None) -> Path:
    """(Re)write ``data/train_prompts.jsonl`` from the lists above."""
    path = Path(path) if path is not None else train_prompts_file()
    rows = build_train_prompts(excluded_prompts())
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
