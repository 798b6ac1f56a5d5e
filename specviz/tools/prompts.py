"""Prompt sets: the benchmark's (held out) and the generated training prompts for distillation.

Training prompts are templates crossed with topics; none may equal or contain a benchmark prompt,
so that acceptance measured on the benchmark is acceptance on text the draft never trained on.
"""

from __future__ import annotations

import random

BENCHMARK_PROMPTS: dict[str, list[str]] = {
    "classic": ["The future of AI", "Robot learning emotions", "Happy Birthday lyrics"],
    "chat": [
        "What are good habits for getting better sleep?",
        "How do I politely decline a meeting invitation?",
    ],
    "code": [
        "Write a Python function that checks whether a string is a palindrome.",
        "Write a JavaScript function that debounces another function.",
    ],
    "edit": [
        "Rewrite this sentence to be more formal: hey, can u send me the report by tomorrow?",
        "Fix the bug in this code:\n\ndef mean(xs):\n    return sum(xs) / len(xs) + 1",
        "Correct the spelling mistakes in this paragraph: Teh weather was beautifull yesterday, so we went to "
        "the park and had a picnik with our freinds.",
        "Rename the variable `total` to `acc` in this code:\n\ndef sum_list(items):\n    total = 0\n"
        "    for item in items:\n        total += item\n    return total",
    ],
}

TEMPLATES = [
    "Write a short story about {t}.",
    "Explain {t} to a ten-year-old.",
    "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Write a poem about {t}.",
    "Summarise the history of {t} in a paragraph.",
    "How does {t} work?",
    "Write a blog post introduction about {t}.",
    "What should a beginner know about {t}?",
    "Describe a day in the life of someone who works with {t}.",
    "List five questions people often ask about {t}, with short answers.",
    "Write an email to a friend recommending {t}.",
    "Compare {t} with something similar and explain the differences.",
    "What are common misconceptions about {t}?",
    "Write a product description for something related to {t}.",
    "Give step-by-step advice for getting started with {t}.",
    "Write a dialogue between two people discussing {t}.",
    "Why is {t} important today?",
    "Write a Python function related to {t}, with a docstring.",
    "Rewrite this more clearly: {t} is kind of a thing that people do a lot and stuff.",
    "Write a limerick about {t}.",
    "What might {t} look like in fifty years?",
    "Write a short speech about {t}.",
    "Summarise the main ideas behind {t} in bullet points.",
    "Write a JavaScript function related to {t}, with comments.",
    "Write a Python class that models {t}.",
    "Fix the grammar in this sentence: {t} are something what many people is interested in.",
    "Correct the spelling in this sentence: I realy enjoyed lerning about {t} last weak.",
    "Make this sentence more formal: {t} is super cool and u should totally check it out.",
    "Continue this story: It all started with {t}.",
    "Explain {t} in one sentence.",
    "Write a haiku about {t}.",
    # second ring (see training_prompts)
    "Write a recipe-style guide to {t}.",
    "What are the biggest challenges in {t}?",
    "Write a news headline and a short article about {t}.",
    "Explain {t} to someone who is sceptical about it.",
    "Give me a study plan for learning about {t} in two weeks.",
    "Write a tweet thread about {t}.",
    "What would a museum exhibit about {t} include?",
    "Write a motivational quote about {t} and explain it.",
    "Write a C function related to {t}, with comments.",
    "Write a unit test in Python for a function related to {t}.",
    "Write a SQL query for a table about {t}, and explain it.",
    "Paraphrase this sentence: {t} has changed the way many people think about the world.",
    "Shorten this sentence: In my personal opinion, I think that {t} is really very interesting indeed.",
    "Translate this to plain English: the utilisation of {t} facilitates optimal outcomes.",
    "What are five fun activities related to {t}?",
    "Write a letter to the editor about {t}.",
    "How would you teach {t} to a class of teenagers?",
    "Tell me a joke about {t}.",
    "What are the ethical questions around {t}?",
    "Write a short mystery story involving {t}.",
    # third ring: the kinds of prompt the benchmark has (bare phrases, advice, code with a task or a snippet, edits of
    # given text), none of them a benchmark prompt
    "{t}",
    "A song about {t}",
    "Notes on {t}",
    "The story of {t}",
    "Can you give me some advice about {t}?",
    "I'm nervous about {t}. What should I do?",
    "What is a simple way to get into {t} on a budget?",
    "What questions should I ask an expert on {t}?",
    "Write a Python function that takes a list of dictionaries about {t} and returns them sorted by name.",
    "Write a JavaScript function that counts the words in a description of {t}.",
    "Write a Python function that checks whether a sentence mentions {t}, ignoring case.",
    "Explain what this code does:\n\nfacts = {{'topic': '{t}', 'count': 3}}\nfor key, value in facts.items():\n"
    "    print(key, value)",
    "Fix the bug in this code:\n\ndef describe(topic):\n    return 'All about ' + topic.upper(\n\n"
    "print(describe('{t}'))",
    "Add comments to this code:\n\ndef count_mentions(texts):\n    return sum('{t}' in text for text in texts)",
    "Rename the function `f` to `describe` in this code:\n\ndef f(x):\n    return 'This is about ' + x\n\n"
    "print(f('{t}'))",
    "Rewrite this sentence to sound more friendly: attendance at the talk on {t} is mandatory for all staff.",
    "Correct the spelling mistakes in this sentence: I have allways wanted to lern more about {t}, but I never had "
    "teh time.",
    "Make this paragraph shorter: {t} is a subject that many people find interesting, and there are many reasons "
    "why people find it interesting, which we will now discuss one by one.",
    "Turn these notes into a short paragraph: {t}; why it matters; one surprising fact; where to learn more.",
    "Reply to this message from a friend: hey, do you know anything about {t}? I have to give a talk on it.",
    # fourth ring: more of each kind, and lists, tables, plans and longer code
    "The secret of {t}",
    "Lyrics for a folk song about {t}",
    "My thoughts on {t}",
    "How can I stay motivated while learning about {t}?",
    "What is the best way to explain {t} to my grandparents?",
    "I have one free afternoon. How could I spend it on {t}?",
    "Write a Python function that reads a CSV file of {t} records and returns the number of rows.",
    "Write a Python generator that yields the words of a text about {t}, one at a time.",
    "Write a JavaScript function that turns a list of facts about {t} into an HTML list.",
    "Write a shell command that finds every file whose name mentions {t}.",
    "Explain what this code does:\n\nnames = ['{t}', 'other']\nprint(sorted(names, key=len))",
    "Fix the bug in this code:\n\nfor i in range(3)\n    print('{t}', i)",
    "Add type hints to this code:\n\ndef label(name, count):\n    return f'{{name}} ({{count}}): {t}'",
    "Rewrite this sentence in the passive voice: the committee discussed {t} for three hours.",
    "Correct the grammar in this sentence: me and my friend goes to learn about {t} every weeks.",
    "Make this sentence simpler: the phenomenon of {t} exhibits a multiplicity of interrelated characteristics.",
    "Turn this into a bulleted list: {t} is old, it is useful, it is misunderstood and it is changing.",
    "Write a short FAQ about {t}.",
    "Make a table of three facts about {t}, with a source type for each.",
    "Plan a one-week project about {t} for a school club.",
    "Write a riddle whose answer is {t}.",
    "Summarise a debate for and against {t} in four sentences.",
    "Write the opening paragraph of a novel set around {t}.",
    "Give a two-minute talk outline on {t}.",
]

TOPICS = [
    "the ocean", "volcanoes", "honeybees", "black holes", "the printing press", "chess", "coffee", "rainforests",
    "electric cars", "the immune system", "ancient Rome", "jazz music", "photosynthesis", "the internet",
    "machine learning", "gardening", "the moon landing", "recycling", "mountain climbing", "bread baking",
    "solar power", "dinosaurs", "the French revolution", "origami", "public libraries", "marathon running",
    "sourdough", "quantum computing", "bird migration", "the stock market", "video games", "yoga",
    "earthquakes", "the human brain", "penguins", "clean water", "the Silk Road", "robots in factories",
    "climate change", "a lighthouse keeper", "space travel", "friendship", "a small bakery", "learning a language",
    "cybersecurity", "the water cycle", "electric guitars", "vaccines", "the Olympic games", "a lost dog",
    "time management", "desert animals", "the Renaissance", "3D printing", "tea ceremonies", "sleep",
    "bicycles", "smartphones", "coral reefs", "a rainy city", "wolves", "democracy", "the periodic table",
    "a haunted house", "cooking pasta", "wind turbines", "museums", "sorting algorithms", "linked lists",
    "SQL databases", "web servers", "unit testing", "version control with git", "recursion", "JSON files",
    "regular expressions", "spreadsheets", "budgeting", "a job interview", "kindness", "winter holidays",
    "a science fair", "trains", "pirates", "dragons", "a detective", "northern lights", "mushrooms",
    "the Pyramids", "typography", "podcasts", "board games", "carnivorous plants", "the Arctic", "nuclear fusion",
    # second ring (see training_prompts)
    "glaciers", "octopuses", "the Great Wall of China", "knitting", "hot air balloons", "submarines", "tornadoes",
    "ancient Egypt", "the violin", "street food", "city parks", "electric bikes", "satellites", "the Amazon river",
    "beekeeping", "chocolate", "the human heart", "fossils", "rock climbing", "skateboarding", "thunderstorms",
    "the Vikings", "classical music", "photography", "cloud computing", "hash tables", "binary search",
    "REST APIs", "password managers", "open source software", "compilers", "operating systems", "spaceships",
    "a small town", "a road trip", "moving house", "public speaking", "remote work", "minimalism", "composting",
    "elephants", "sharks", "owls", "butterflies", "the Moon", "Mars", "comets", "the Sahara", "rivers",
    "lighthouses", "castles", "windmills", "the Industrial Revolution", "the telephone", "paper", "maps",
    "first aid", "healthy breakfasts", "running shoes", "a birthday party",
    # fourth ring (see training_prompts)
    "rain gardens", "the Roman aqueducts", "jellyfish", "the metric system", "calligraphy", "kites", "tides",
    "the printing of money", "honey", "lichen", "a night market", "the postal service", "electric trains",
    "a mountain village", "seahorses", "cheese making", "the Hubble telescope", "frogs", "a school garden",
    "sign language", "wildfires", "the piano", "ice skating", "a secondhand bookshop", "red pandas",
    "bridges", "the Mediterranean diet", "tidal energy", "tree rings", "the compass", "volunteering",
    "caching", "binary trees", "async programming", "command-line tools", "data visualisation", "encryption",
    "memory leaks", "code reviews", "API rate limits", "queues", "floating-point numbers", "Unicode",
    "a farmers' market", "night shifts", "a family reunion", "saving money", "learning to swim",
    "a camping trip", "houseplants", "street art", "a jazz club", "snowflakes", "the Great Barrier Reef",
    "hummingbirds", "the Andes", "a train station", "the Eiffel Tower", "letter writing", "a thunderstorm at sea",
]


# (templates, topics) each ring spans: ring 2 is the first 52 templates x the first 155 topics less ring 1, and so on
RINGS = ((32, 95), (52, 155), (72, 155), (len(TEMPLATES), len(TOPICS)))


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts from TEMPLATES x TOPICS (at most their product), in a seeded order.

    The order goes ring by ring, each shuffled: templates and topics added in a later ring leave the
    first prompts as they were (the shipped heads' configurations name their prompt count)."""
    held_out = [p.lower() for ps in BENCHMARK_PROMPTS.values() for p in ps]
    prompts: list[str] = []
    inner = (0, 0)
    for ring in RINGS:
        combos = [TEMPLATES[i].format(t=TOPICS[j]) for i in range(ring[0]) for j in range(ring[1])
                  if i >= inner[0] or j >= inner[1]]
        combos = [c for c in combos if not any(h in c.lower() or c.lower() in h for h in held_out)]
        random.Random(seed).shuffle(combos)
        prompts += combos
        inner = ring
    return prompts[:n]
