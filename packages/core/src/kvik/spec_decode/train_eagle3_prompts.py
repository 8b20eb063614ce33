"""Instructions for training and evaluating an EAGLE-3 head on a chat model's own answers.

Evaluation prompts (``held_out_instructions``) pair the last topics of ``_TOPICS`` with
``_EVAL_TEMPLATES``; validation prompts pair topics of their own with the same templates; training
prompts pair every other topic with every template, so no evaluated or validation topic is ever
answered in training (a test checks that no such topic word appears in a training prompt).
"""

from __future__ import annotations

import random

_TOPICS = (
    "volcanoes", "the moon", "honey bees", "the Roman empire", "photosynthesis", "chess",
    "rainbows", "the internet", "coffee", "glaciers", "the human heart", "electric cars",
    "the piano", "deserts", "penguins", "bread baking", "earthquakes", "the printing press",
    "solar panels", "whales", "the Olympic games", "vaccines", "tea", "the Amazon rainforest",
    "black holes", "bicycles", "the water cycle", "dinosaurs", "money", "the Eiffel tower",
    "recycling", "sleep", "the ocean tides", "libraries", "mountains", "the alphabet",
    "airplanes", "bananas", "friendship", "the weather", "trains", "the brain", "gardening",
    "clocks", "music", "spiders", "the stock market", "snow", "football", "robots",
    "the Nile", "cheese", "lightning", "mathematics", "owls", "the telephone", "forests",
    "birthdays", "maps", "the sun", "rivers", "castles", "cats", "dogs", "salt",
    "ancient Egypt", "the camera", "rice", "wind turbines", "the guitar", "coral reefs",
    "elephants", "paper", "the Great Wall of China", "oxygen", "kites", "pizza", "stars",
)  # fmt: skip
#: The last topics are held out: evaluation prompts share no topic with training ones.
NUM_HELD_OUT_TOPICS = 8

#: Topics of the validation instructions (choosing which weights a training run keeps): in
#: neither training nor evaluation, so that the choice does not see the evaluated topics.
_VALIDATION_TOPICS = (
    "giraffes", "the Panama Canal", "lemons", "snails", "the Colosseum", "sand",
)  # fmt: skip

#: Training-only topics, none naming a held-out topic.
_MORE_TOPICS = (
    "climate change", "the French revolution", "DNA", "smartphones", "the Moon landing",
    "basketball", "tigers", "origami", "the immune system", "democracy", "jazz", "ants",
    "the Renaissance", "submarines", "tornadoes", "chocolate", "the human skeleton",
    "video games", "butterflies", "the Arctic", "bridges", "magnets", "yoga", "sharks",
    "the periodic table", "public speaking", "time management", "the solar system",
    "recycling plastic", "volunteering", "the Sahara", "hurricanes", "the Industrial Revolution",
    "gravity", "frogs", "wine making", "the Vikings", "microscopes", "nuclear power",
    "the Silk Road", "poetry", "dolphins", "skyscrapers", "the Mayan civilization",
    "cloud computing", "artificial intelligence", "meditation", "the ocean floor",
    "mushrooms", "the violin", "marathon running", "horses", "the Statue of Liberty",
    "batteries", "fossils", "the Moon's phases", "camping", "journaling", "the Alps",
    "language learning", "fire", "the metric system", "volleyball", "apples", "windmills",
    "the human eye", "cooking pasta", "bats", "photography", "the Grand Canyon",
    "credit cards", "the Middle Ages", "tsunamis", "jellyfish", "the Beatles",
    "ballet", "quantum physics", "email etiquette", "potatoes", "the Pyramids of Giza",
    "cybersecurity", "bees and flowers", "sunflowers", "the Titanic", "wolves", "deserts at night",
    "the printing of books", "rock climbing", "olive oil", "the Mona Lisa", "bamboo",
    "carbon dioxide", "typewriters", "the Arctic fox", "origami cranes", "electricity",
    "opera", "the human stomach", "hiking safety", "saving money", "teamwork", "sushi",
    "hot air balloons", "the Milky Way", "lighthouses", "the compass", "ice cream",
    "a healthy breakfast", "learning to swim", "the Sydney Opera House", "parrots",
    "the rainforest canopy", "renewable energy", "the human voice", "board games",
    "writing a resume", "the first computers", "the Himalayas", "octopuses", "silk",
    "farming", "ancient Greece", "the Aurora Borealis", "tennis", "glass making",
    "caterpillars", "the postal service", "volcanic islands", "kangaroos", "submarine cables",
)  # fmt: skip

#: The templates evaluation uses (training uses them too, on other topics).
_EVAL_TEMPLATES = (
    "Write a short paragraph about {}.",
    "Explain {} to a ten-year-old.",
    "What are three interesting facts about {}?",
    "Why is {} important?",
    "Describe the history of {} briefly.",
    "Give me a list of five words related to {}.",
)
_MORE_TEMPLATES = (
    "Tell me about {}.",
    "Write a short poem about {}.",
    "What is {}?",
    "How does {} work?",
    "Summarize what you know about {} in two sentences.",
    "Write a short story that involves {}.",
    "What are the advantages and disadvantages of {}?",
    "Give me some tips related to {}.",
    "Write an email to a friend about {}.",
    "What would a scientist say about {}?",
    "Compare {} with something similar.",
    "Write a blog post introduction about {}.",
    "What are common misconceptions about {}?",
    "Create a quiz question about {}.",
    "Describe {} in simple words.",
    "Why do people find {} interesting?",
    "Write a haiku about {}.",
    "What is the future of {}?",
    "Can you teach me something new about {}?",
    "Write a product description related to {}.",
)


def held_out_instructions() -> list[str]:
    """The evaluation instructions: held-out topics with the evaluation templates."""
    topics = _TOPICS[-NUM_HELD_OUT_TOPICS:]
    return [template.format(topic) for topic in topics for template in _EVAL_TEMPLATES]


def held_out_topics() -> tuple[str, ...]:
    return _TOPICS[-NUM_HELD_OUT_TOPICS:]


def validation_instructions() -> list[str]:
    """The validation topics with the evaluation templates."""
    return [template.format(topic) for topic in _VALIDATION_TOPICS for template in _EVAL_TEMPLATES]


def validation_topics() -> tuple[str, ...]:
    return _VALIDATION_TOPICS


def training_instructions(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct training instructions: the first of every non-held-out topic paired with
    every template, shuffled with ``seed`` (so a smaller count gives a prefix of a larger one)."""
    topics = _TOPICS[:-NUM_HELD_OUT_TOPICS] + _MORE_TOPICS
    templates = _EVAL_TEMPLATES + _MORE_TEMPLATES
    pool = [template.format(topic) for topic in topics for template in templates]
    if not 0 < count <= len(pool):
        raise ValueError(
            f"count must be in [1, {len(pool)}] (the training instructions), got {count}"
        )
    random.Random(seed).shuffle(pool)
    return pool[:count]


def num_training_instructions() -> int:
    return (len(_TOPICS) - NUM_HELD_OUT_TOPICS + len(_MORE_TOPICS)) * (
        len(_EVAL_TEMPLATES) + len(_MORE_TEMPLATES)
    )
