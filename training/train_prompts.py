"""Prompts for `specserve train-draft`, written for this project (no data set is downloaded).

The target answers them itself; the head learns from the target's own text, which is what it has
to predict when serving. Two kinds, shaped like what the server sees: chat requests (one user
message through the chat template) and raw code completions (a signature and a docstring).
They are combinations of short hand-written parts; none is taken from HumanEval or MT-Bench, and
`train-draft` checks and reports the n-gram overlap with both.
"""

from __future__ import annotations

import random

_TOPICS = [
    "photosynthesis", "the water cycle", "compound interest", "black holes", "the immune system",
    "machine learning", "the French Revolution", "plate tectonics", "supply and demand",
    "the Roman Empire", "climate change", "vaccines", "electric cars", "the stock market",
    "recycling", "the human heart", "volcanoes", "the internet", "coffee", "sleep",
    "the moon landing", "bees", "renewable energy", "inflation", "the printing press",
    "democracy", "DNA", "gravity", "rainbows", "earthquakes", "chess", "jazz music",
    "the Olympic Games", "honey", "glaciers", "solar panels", "public libraries",
    "time zones", "credit scores", "migratory birds", "bread baking", "the periodic table",
    "ocean tides", "password security", "remote work", "city parks", "spiders", "tea",
    "the Great Wall of China", "antibiotics", "3D printing", "rain forests", "meditation",
]
_CHAT_TEMPLATES = [
    "Explain {topic} in simple terms.",
    "What is {topic}? Answer in a short paragraph.",
    "Give me three interesting facts about {topic}.",
    "Write a short poem about {topic}.",
    "Summarize the main ideas behind {topic} for a high school student.",
    "What are the pros and cons of {topic}?",
    "Write a short story for children that involves {topic}.",
    "How would you teach {topic} to a ten-year-old?",
    "List five questions a curious person might ask about {topic}, with brief answers.",
    "Write a tweet about {topic}.",
    "Describe the history of {topic} in a few sentences.",
    "What misconceptions do people often have about {topic}?",
]
_ADVICE = [
    "How can I get better at public speaking?", "What should I pack for a weekend camping trip?",
    "How do I start learning to play the guitar?", "Give me tips for saving money on groceries.",
    "How can I sleep better at night?", "What is a good morning routine?",
    "How do I write a polite email asking for a deadline extension?",
    "Suggest a healthy dinner I can cook in twenty minutes.",
    "How should I prepare for a job interview?", "What are good habits for learning a language?",
    "Plan a one-day visit to a museum with kids.", "How do I keep houseplants alive?",
    "Write a thank-you note to a neighbor who watered my plants.",
    "What are some fun indoor activities for a rainy day?",
    "How can a small team run better meetings?", "Give me a simple weekly exercise plan.",
    "How do I explain a gap in my resume?", "What should I consider before adopting a dog?",
    "Draft a short message inviting friends to a picnic on Saturday.",
    "How do I make a budget for the first time?", "Write a product description for a water bottle.",
    "Compare trains and planes for a 500 km trip.", "How can I reduce stress during exams?",
    "Write a short speech for a friend's birthday.", "How do I organize my email inbox?",
]
_MATH = [
    "What is {a} plus {b}?", "A shop sells pens at {a} cents each. How much do {b} pens cost?",
    "If a train travels {a} km in {b} hours, what is its average speed?",
    "Is {a} a prime number? Explain.", "What is {a} percent of {b}?",
    "Sort these numbers from smallest to largest: {a}, {b}, {c}.",
]
_CODE_CHAT = [
    "Write a Python function that {task}.", "How do I {task} in Python? Show an example.",
    "Explain, with a short code example, how to {task} in JavaScript.",
]
_TASKS = [
    "reverses a string", "counts the vowels in a sentence", "checks whether a year is a leap year",
    "merges two sorted lists", "finds the largest number in a list", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "reads a CSV file and prints each row",
    "computes the factorial of a number", "checks if a word is a palindrome",
    "flattens a nested list", "counts word frequencies in a text", "returns the nth prime",
    "validates an email address with a regular expression", "computes the median of a list",
    "groups a list of words by their first letter", "rotates a list by k positions",
    "parses a date string", "finds common elements of two lists", "sums the digits of a number",
    "converts a dictionary to JSON", "capitalizes every word in a sentence",
    "computes a running total", "chunks a list into pieces of size n",
    "finds the longest word in a sentence", "checks whether two strings are anagrams",
]
# Raw completions: a signature and docstring; the target writes the body.
_FUNCTIONS = [
    ("word_lengths", "sentence: str", "list[int]", "Return the length of every word in the sentence."),
    ("clamp", "value: float, low: float, high: float", "float", "Limit value to the range [low, high]."),
    ("count_upper", "text: str", "int", "Count the uppercase letters in text."),
    ("is_sorted", "items: list[int]", "bool", "Return True if items are in non-decreasing order."),
    ("invert_dict", "mapping: dict", "dict", "Swap the keys and values of mapping."),
    ("second_largest", "numbers: list[int]", "int", "Return the second largest distinct number."),
    ("title_case", "text: str", "str", "Capitalize the first letter of every word."),
    ("chunk", "items: list, size: int", "list[list]", "Split items into lists of at most size elements."),
    ("digits_sum", "n: int", "int", "Return the sum of the decimal digits of n."),
    ("running_max", "values: list[int]", "list[int]", "Return the maximum seen so far at each index."),
    ("char_histogram", "text: str", "dict[str, int]", "Count how often each character appears."),
    ("fizzbuzz", "n: int", "list[str]", "Return the FizzBuzz sequence from 1 to n."),
    ("mean", "values: list[float]", "float", "Return the arithmetic mean; 0.0 for an empty list."),
    ("dedupe", "items: list", "list", "Remove duplicates while keeping the first occurrence order."),
    ("to_snake_case", "name: str", "str", "Convert a CamelCase name to snake_case."),
    ("gcd", "a: int, b: int", "int", "Return the greatest common divisor of a and b."),
    ("transpose", "matrix: list[list[int]]", "list[list[int]]", "Return the transpose of matrix."),
    ("count_words", "text: str", "int", "Return the number of whitespace-separated words."),
    ("nth_fibonacci", "n: int", "int", "Return the nth Fibonacci number, starting from 0, 1."),
    ("safe_divide", "a: float, b: float", "float | None", "Divide a by b; None when b is zero."),
    ("pairwise_sums", "values: list[int]", "list[int]", "Sum each element with the next one."),
    ("vowel_positions", "word: str", "list[int]", "Return the indices of vowels in word."),
    ("merge_intervals", "intervals: list[tuple[int, int]]", "list[tuple[int, int]]",
     "Merge overlapping closed intervals."),
    ("binary_string", "n: int", "str", "Return the binary representation of a non-negative n."),
    ("most_common", "items: list[str]", "str", "Return the item that appears most often."),
    ("rotate_left", "items: list, k: int", "list", "Rotate items to the left by k positions."),
    ("strip_comments", "source: str", "str", "Remove # comments from each line of Python source."),
    ("is_power_of_two", "n: int", "bool", "Return True if n is a power of two."),
    ("matrix_sum", "matrix: list[list[float]]", "float", "Return the sum of all entries."),
    ("compress", "text: str", "str", "Run-length encode text, e.g. 'aab' becomes 'a2b1'."),
    ("balanced", "brackets: str", "bool", "Return True if every bracket is closed in order."),
    ("celsius_table", "start: int, stop: int", "list[tuple[int, float]]",
     "Pair each Celsius degree in [start, stop) with its Fahrenheit value."),
]


def chat_prompts(rng: random.Random, templates_per_topic: int = 3) -> list[str]:
    """User messages: explanations, advice, small sums, code questions."""
    prompts = [t.format(topic=topic) for topic in _TOPICS
               for t in rng.sample(_CHAT_TEMPLATES, templates_per_topic)]
    prompts += _ADVICE
    for template in _MATH:
        for _ in range(3):
            a, b, c = rng.randint(2, 400), rng.randint(2, 90), rng.randint(2, 999)
            prompts.append(template.format(a=a, b=b, c=c))
    prompts += [t.format(task=task) for task in _TASKS for t in rng.sample(_CODE_CHAT, 1)]
    rng.shuffle(prompts)
    return prompts


def code_prompts() -> list[str]:
    """Raw completion prompts: a typed signature and a docstring, the body left to the model."""
    return [f'def {name}({args}) -> {returns}:\n    """{doc}\n    """\n'
            for name, args, returns, doc in _FUNCTIONS]


# Second user turns, asked after the target's first answer: multi-turn text to train on.
FOLLOW_UPS = [
    "Can you give a concrete example?",
    "Explain that more simply, please.",
    "Summarize your answer in three short bullet points.",
    "What is a common mistake people make with this?",
    "Can you say more about the most important point?",
    "How would you explain this to a beginner?",
]
