"""Build the built-in training prompts: specdec_runtime/data/prompts-train.jsonl.

    python scripts/make_prompts.py            # rewrites the file (deterministic: the same file every time)

2048 prompts, 256 in each of the eight categories of the validation set (coding, math, reasoning,
writing, summarization, extraction, translation, qa): the 32 hand-written prompts per category the
project started with, then prompts composed from the templates, topics, passages and sentences
written below for this project (no outside data), about one in ten of them a multi-turn
conversation that ends with the user's follow-up. None repeats a validation prompt.
"""

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "specdec_runtime" / "data"
PER_CATEGORY = 256

LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "Ruby", "Kotlin", "Bash"]
CODE_TASKS = [
    "reverses the words in a sentence",
    "checks whether a number is prime",
    "merges two sorted lists into one sorted list",
    "counts how often each word appears in a text",
    "flattens a nested list of lists",
    "returns the n-th Fibonacci number iteratively",
    "removes duplicate values while keeping their order",
    "finds the longest common prefix of a list of strings",
    "checks whether two strings are anagrams",
    "rotates a square matrix by 90 degrees clockwise",
    "splits a list into chunks of size n",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the indices of the two numbers in a list that add up to a target",
    "validates that brackets in a string are balanced",
    "computes the greatest common divisor of two integers",
    "capitalizes the first letter of every word",
    "finds the most frequent element of a list",
    "converts a Roman numeral to an integer",
    "returns all prime numbers below n",
    "computes the running total of a list of numbers",
    "checks whether a year is a leap year",
    "truncates a string to n characters and adds an ellipsis",
    "converts a snake_case name to camelCase",
    "returns the median of a list of numbers",
    "counts the vowels in a string",
    "finds the second smallest value in a list",
    "groups a list of words by their first letter",
    "implements binary search on a sorted list",
    "sums the digits of an integer",
    "checks whether a string is a valid IPv4 address",
    "returns the intersection of two lists",
    "formats a number of seconds as HH:MM:SS",
    "removes all whitespace from a string",
    "computes the factorial of n recursively",
    "finds the longest word in a sentence",
    "converts a list of pairs into a dictionary",
    "checks whether a list is sorted",
    "generates a random password of a given length",
    "counts the lines, words and characters of a text",
    "transposes a matrix",
]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "In {lang}, write a short program that {task}, and explain each line.",
    "Show how to write a {lang} function that {task}. Include a small usage example.",
    "Write a {lang} function that {task}, then say what its time complexity is.",
]
CODE_QUESTIONS = [
    "What is the difference between `==` and `is` in Python?",
    "What does the `yield` keyword do in Python?",
    "Explain what a closure is in JavaScript with a short example.",
    "What is the difference between `let`, `const` and `var` in JavaScript?",
    "What does the `?` operator do in Rust?",
    "Explain Go's `defer` statement with an example.",
    "What is a race condition, and how can a mutex prevent it?",
    "What is the difference between a process and a thread?",
    "Explain Big-O notation in simple terms.",
    "What is recursion? Give a simple example.",
    "What does `git rebase` do, and how is it different from `git merge`?",
    "What is the difference between an array and a linked list?",
    "Explain what a hash table is and why lookups are fast.",
    "What is the difference between SQL's INNER JOIN and LEFT JOIN?",
    "What is an API, explained for a beginner?",
    "What are Python decorators? Show a simple one.",
    "What is the difference between a stack and a queue?",
    "Explain what `async` and `await` do in JavaScript.",
    "What does `const` mean for a pointer in C?",
    "What is dependency injection, in plain words?",
]
CODE_FOLLOWUPS = [
    "Now add type hints and a docstring.",
    "Can you make it handle an empty input?",
    "Now write two unit tests for it.",
    "Can you make it faster?",
    "Rewrite it without using any loops.",
]

MATH_TEMPLATES = [
    lambda r: f"What is {r.choice([5, 10, 12, 15, 20, 25, 30, 40, 75])}% of {r.randrange(40, 900, 10)}?",
    lambda r: f"Solve for x: {r.randint(2, 9)}x + {r.randint(1, 30)} = {r.randint(31, 120)}.",
    lambda r: f"A train travels {r.randrange(60, 600, 20)} km in {r.randint(2, 8)} hours. What is its average speed?",
    lambda r: (
        f"A rectangle is {r.randint(3, 30)} cm long and {r.randint(2, 20)} cm wide. What are its area and perimeter?"
    ),
    lambda r: f"What is the sum of all integers from 1 to {r.choice([10, 20, 50, 100, 200])}?",
    lambda r: f"Convert {r.randint(70, 500)} minutes into hours and minutes.",
    lambda r: (
        f"A jacket costs ${r.randrange(40, 200, 5)} and is on sale for {r.choice([10, 20, 25, 30, 40])}% off. What is the sale price?"
    ),
    lambda r: (
        f"If {r.randint(2, 6)} workers finish a job in {r.randint(4, 12)} days, how many days would {r.randint(7, 12)} workers take, working at the same rate?"
    ),
    lambda r: (
        f"Find the mean and the median of these numbers: {', '.join(str(r.randint(1, 50)) for _ in range(r.randint(5, 8)))}."
    ),
    lambda r: f"Simplify the fraction {(a := r.randint(2, 9)) * (k := r.randint(2, 12))}/{a * r.randint(k + 1, 20)}.",
    lambda r: (
        f"A bag has {r.randint(2, 8)} red, {r.randint(2, 8)} blue and {r.randint(2, 8)} green marbles. What is the probability of drawing a blue one?"
    ),
    lambda r: f"What is {r.randint(12, 99)} multiplied by {r.randint(12, 99)}? Show your steps.",
    lambda r: (
        f"A recipe needs {r.randint(2, 5)} cups of flour for {r.randint(8, 16)} cookies. How much flour is needed for {r.randint(20, 60)} cookies?"
    ),
    lambda r: f"What is the area of a circle with a radius of {r.randint(2, 15)} meters? Use pi = 3.14.",
    lambda r: f"You save ${r.randint(5, 40)} a week. How many weeks until you have ${r.randrange(200, 1000, 50)}?",
    lambda r: (
        f"A car uses {r.randint(5, 9)} liters of fuel per 100 km. How much fuel does it need for {r.randrange(150, 900, 50)} km?"
    ),
    lambda r: f"What is {r.randint(2, 9)} to the power of {r.randint(2, 5)}?",
    lambda r: f"Is {r.randint(50, 300)} a prime number? Explain how you checked.",
    lambda r: (
        f"A store sells pens at {r.randint(2, 5)} for ${r.randint(3, 9)}. How much do {r.randint(10, 40)} pens cost?"
    ),
    lambda r: (
        f"The ratio of cats to dogs in a shelter is {r.randint(2, 5)}:{r.randint(3, 7)}, and there are {r.randint(30, 80)} animals in total. How many are cats?"
    ),
]
MATH_FOLLOWUPS = [
    "Can you explain that more simply?",
    "How would you check that the answer is right?",
    "Now do it with the numbers doubled.",
]

NAMES = [
    "Alice",
    "Ben",
    "Carla",
    "David",
    "Emma",
    "Farid",
    "Grace",
    "Hiro",
    "Ines",
    "Jonas",
    "Kemi",
    "Liam",
    "Maya",
    "Noor",
    "Omar",
    "Priya",
]
THINGS = ["bloops", "razzies", "lazzies", "snarks", "glimmers", "quoxes", "vindles", "trems"]
REASONING_TEMPLATES = [
    lambda r: (lambda a, b, c: f"{a} is older than {b}, and {b} is older than {c}. Who is the youngest? Explain.")(
        *r.sample(NAMES, 3)
    ),
    lambda r: (
        lambda a, b, c: f"If all {a} are {b} and some {b} are {c}, must some {a} be {c}? Explain your reasoning."
    )(*r.sample(THINGS, 3)),
    lambda r: (
        f"What number comes next in the sequence {', '.join(str(r.randint(1, 4) * i * i + r.randint(0, 3)) for i in range(1, 6))}, ...? Explain the pattern you see."
    ),
    lambda r: (
        f"Today is {r.choice(['Monday', 'Tuesday', 'Wednesday', 'Thursday', 'Friday', 'Saturday', 'Sunday'])}. What day of the week will it be in {r.randint(10, 100)} days?"
    ),
    lambda r: (
        lambda a, b: (
            f"{a} says: 'If it rains, I take the bus.' {a} did not take the bus today. What can {b} conclude about the weather?"
        )
    )(*r.sample(NAMES, 2)),
    lambda r: (
        f"A clock shows {r.randint(1, 12)}:{r.choice(['00', '15', '30', '45'])}. What is the angle between the hour and the minute hands?"
    ),
    lambda r: (
        lambda a, b, c: (
            f"{a}, {b} and {c} each own one pet: a cat, a dog or a fish. {a} is allergic to fur, and {b} walks their pet every morning. Who owns which pet?"
        )
    )(*r.sample(NAMES, 3)),
    lambda r: (
        f"In a race, you pass the person in {r.choice(['second', 'third', 'fourth', 'last'])} place. What place are you in now? Explain."
    ),
    lambda r: (
        f"A box holds {r.randint(3, 9)} red socks and {r.randint(3, 9)} black socks. In the dark, how many socks must you take to be sure of a matching pair?"
    ),
    lambda r: (
        f"Is this argument valid? 'Every {r.choice(['student', 'doctor', 'pilot', 'painter'])} I know likes coffee. {r.choice(NAMES)} likes coffee. So {r.choice(NAMES)} is one of them.' Explain."
    ),
    lambda r: (
        f"If it takes {r.randint(3, 9)} machines {r.randint(3, 9)} minutes to make that many widgets, how long would 100 machines take to make 100 widgets?"
    ),
    lambda r: (
        lambda a, b: (
            f"{a} has twice as many books as {b}. Together they have {r.randint(4, 40) * 3} books. How many does each have?"
        )
    )(*r.sample(NAMES, 2)),
    lambda r: (
        f"Which is larger: {r.randint(2, 9)}/{r.randint(10, 20)} or {r.randint(2, 9)}/{r.randint(10, 20)}? Explain how you compare them."
    ),
    lambda r: (
        f"A snail climbs {r.randint(3, 5)} meters up a wall each day and slides back {r.randint(1, 2)} meters each night. The wall is {r.randint(10, 20)} meters high. On which day does it reach the top?"
    ),
    lambda r: (
        f"Give one strong argument for and one against {r.choice(['a four-day work week', 'school uniforms', 'banning cars from city centers', 'homework for young children', 'remote work', 'daylight saving time'])}."
    ),
    lambda r: (
        f"You have a {r.randint(3, 5)}-liter jug and a {r.randint(7, 9)}-liter jug. How can you measure exactly {r.randint(1, 6)} liters of water? Explain the steps, or why it is impossible."
    ),
]
REASONING_FOLLOWUPS = [
    "Are you sure? Check your answer once more.",
    "Can you explain it step by step?",
    "What would change if one of the facts were different?",
]

FORMS = [
    "a four-line poem",
    "a haiku",
    "a limerick",
    "the opening paragraph of a short story",
    "a two-sentence scary story",
    "a product description of about 50 words",
    "a short motivational speech",
    "a diary entry",
    "a tweet announcing",
    "a short fable with a moral",
    "a funny dialogue between two characters",
    "a short letter to a future self",
]
TOPICS = [
    "the first snow of winter",
    "a lighthouse keeper",
    "a city at night",
    "a lost umbrella",
    "learning to ride a bicycle",
    "a robot who loves gardening",
    "the smell of rain",
    "an old library",
    "moving to a new city",
    "a cup of morning coffee",
    "the ocean at dawn",
    "a cat who thinks it is a dog",
    "the last day of summer",
    "a forgotten birthday",
    "a mountain hike",
    "a talking tree",
    "a kitchen disaster",
    "the first day at a new job",
    "a market in the rain",
    "a broken clock",
    "friendship",
    "a night train",
    "an astronaut's first step",
    "a noisy neighbor",
]
EMAILS = [
    ("your landlord", "a leaking kitchen tap"),
    ("a colleague", "moving a meeting to Thursday"),
    ("a teacher", "your child missing school for a day"),
    ("a customer", "a delayed order"),
    ("your team", "a new coffee machine in the office"),
    ("a hotel", "a late check-in"),
    ("a friend", "thanks for a birthday present"),
    ("a manager", "a request for a day off"),
    ("a shop", "returning a broken kettle"),
    ("a neighbor", "a package delivered to the wrong door"),
    ("a club", "cancelling your membership"),
    ("a restaurant", "a table for eight people"),
]
WRITING_FOLLOWUPS = ["Make it shorter.", "Now make it funnier.", "Rewrite it for a child.", "Give it a title."]

PASSAGES = [
    "The town of Brookfield built a small solar farm on an old parking lot in 2018. The panels now provide about a third of the electricity used by the town's public buildings. The project cost less than expected, and the savings are being used to repair the local school's roof.",
    "Octopuses have three hearts and blue blood. Two hearts pump blood through the gills, while the third moves it through the rest of the body. When an octopus swims, the third heart stops beating, which is one reason they prefer crawling.",
    "A growing number of people work from home at least part of the week. Many say they save time and money on commuting. Managers, however, worry that new employees learn more slowly without colleagues nearby to ask for help.",
    "The printing press, developed in Europe around 1440, made books far cheaper to produce. Before it, books were copied by hand and were rare and expensive. Within a few decades, printed books spread new ideas across the continent.",
    "Sleep helps the brain store memories. During deep sleep, the brain replays the events of the day and strengthens the connections that matter. People who sleep well after learning something new usually remember it better the next day.",
    "The city library started lending tools last spring. Members can borrow drills, ladders and sewing machines for up to a week. The program has been so popular that the library plans to double the number of tools next year.",
    "Honey never spoils if it is stored properly. Its low water content and high acidity make it hard for bacteria to grow. Archaeologists have found pots of honey in ancient tombs that were still safe to eat.",
    "Electric scooters appeared in many cities almost overnight. They are cheap and convenient for short trips, but riders often leave them on sidewalks. Several cities now require parking in marked areas and limit the speed in busy streets.",
    "A recent survey asked teenagers how they learn about the news. Most said they see headlines on social media, but few read the full articles. Teachers worry that students see only a small and sometimes misleading part of each story.",
    "The Great Barrier Reef is the largest coral reef system in the world. Warmer seas have caused several bleaching events, in which corals lose the algae that feed them. Scientists are testing heat-resistant corals to help the reef recover.",
    "Bamboo is one of the fastest-growing plants on Earth. Some species can grow almost a meter in a single day. Because it grows so quickly and is very strong, bamboo is used for building, furniture and even clothing.",
    "Many small shops now accept only card payments. Owners say it is safer and faster than handling cash. However, some older customers and people without bank accounts find it harder to buy what they need.",
    "The first marathon was inspired by a legend about a Greek messenger who ran from Marathon to Athens. The modern race distance of 42.195 km was set at the 1908 London Olympics, so that the race could finish in front of the royal box.",
    "Community gardens turn empty lots into shared green spaces. Neighbors grow vegetables, meet each other and teach children where food comes from. Studies suggest these gardens can also make streets feel safer.",
    "Chess computers became stronger than the best human players in the late 1990s. Today, even phone apps can beat world champions. Instead of replacing human players, the programs are now mostly used to train and analyze games.",
    "Glaciers store about two thirds of the world's fresh water. As they melt, they first increase the water flowing in rivers, then slowly reduce it. Towns that depend on glacier water are planning new reservoirs for the dry seasons ahead.",
    "Museums are experimenting with late-night openings. Visitors can see the exhibitions with music, drinks and talks after work. The evenings attract younger visitors who rarely come during the day.",
    "A four-day work week was tested by dozens of companies for six months. Most reported that productivity stayed the same while staff felt less tired. Some firms found it hard to cover customer service on the extra day off.",
    "The human nose can tell apart a huge number of smells. Smell is closely linked to memory, which is why a familiar scent can bring back a childhood moment. Losing the sense of smell can make food taste bland.",
    "Wind turbines turn the energy of moving air into electricity. Modern turbines are taller than many buildings and work best in steady winds, often out at sea. Their main drawback is that they produce power only when the wind blows.",
    "Recycling plastic is harder than it seems. There are many kinds of plastic, and they often cannot be recycled together. Dirty containers can ruin a whole batch, so sorting and cleaning matter as much as collecting.",
    "Volunteers in the village of Ashford repaired the old footbridge over the river in just three weekends. The council provided the wood, and a retired carpenter led the work. The bridge reopened with a small party for the whole village.",
    "Video calls became part of daily life for many families. Grandparents who had never used a computer learned to join calls to see their grandchildren. Some say the calls made them feel closer than ever, even from far away.",
    "Rice feeds more than half of the world's population. It grows best in warm, wet places, often in flooded fields called paddies. Farmers are testing new varieties that need less water as droughts become more common.",
]
SUMMARY_TEMPLATES = [
    "Summarize the following passage in one sentence:\n\n{p}",
    "Give three bullet points that summarize this text:\n\n{p}",
    "Summarize this for a ten-year-old:\n\n{p}",
    "Write a short headline for this paragraph:\n\n{p}",
    "What is the main point of this text? Answer in two sentences.\n\n{p}",
    "Summarize the passage below in about twenty words.\n\n{p}",
    "List the key facts in this paragraph:\n\n{p}",
    "TL;DR:\n\n{p}",
    "Rewrite this paragraph as a single short tweet:\n\n{p}",
    "What problem does this text describe, and what is being done about it?\n\n{p}",
]
SUMMARY_FOLLOWUPS = ["Now make it even shorter.", "Which detail did you leave out, and why?"]

FIRST = [
    "Sarah",
    "David",
    "Rachel",
    "Tom",
    "Aisha",
    "Marco",
    "Yuki",
    "Elena",
    "Samuel",
    "Fatima",
    "Lucas",
    "Mei",
    "Olga",
    "Kwame",
    "Nina",
    "Pedro",
]
LAST = ["Kim", "Osei", "Moreno", "Becker", "Nakamura", "Rossi", "Haddad", "Novak", "Silva", "Larsen", "Chen", "Dubois"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
PRODUCTS = [
    "wireless headphones",
    "a garden hose",
    "a desk lamp",
    "running shoes",
    "a coffee grinder",
    "a backpack",
    "a phone case",
    "a yoga mat",
]
CITIES = [
    "Lisbon",
    "Toronto",
    "Nairobi",
    "Osaka",
    "Berlin",
    "Denver",
    "Lyon",
    "Seoul",
    "Austin",
    "Porto",
    "Krakow",
    "Dublin",
]
EXTRACTION_TEMPLATES = [
    lambda r: (
        f"Extract all the people's names from this text and list them:\n\nAt the meeting, {_person(r)} presented the plan, while {_person(r)} and {_person(r)} asked questions. Later, {_person(r)} joined by phone."
    ),
    lambda r: (
        f"From the text below, extract every date and return them as a JSON list in YYYY-MM-DD format.\n\nThe order was placed on {_date(r)}, shipped on {_date(r)} and delivered on {_date(r)}."
    ),
    lambda r: (
        f'Extract the product, price and city from this sentence and return JSON with the keys "product", "price" and "city":\n\nA customer in {r.choice(CITIES)} bought {r.choice(PRODUCTS)} for ${r.randint(9, 250)}.{r.randint(0, 99):02d}.'
    ),
    lambda r: (
        f"List every email address that appears in this message:\n\nHi team, please send the report to {_email(r)} and copy {_email(r)}. Questions go to {_email(r)}."
    ),
    lambda r: (
        f"From this meeting note, extract the action items and who owns each one:\n\n{_person(r)} will book the venue by Friday. {_person(r)} is drafting the invitation. {_person(r)} will ask for the budget approval."
    ),
    lambda r: (
        f"Extract the flight number, departure city and departure time from this text:\n\nYour flight {r.choice(['AB', 'TK', 'LX', 'QF'])}{r.randint(100, 999)} leaves {r.choice(CITIES)} at {r.randint(5, 22)}:{r.choice(['05', '20', '35', '50'])} and arrives in {r.choice(CITIES)} three hours later."
    ),
    lambda r: (
        f"Find all the numbers in this text and add them up:\n\nWe sold {r.randint(3, 40)} apples in the morning, {r.randint(3, 40)} in the afternoon and {r.randint(3, 40)} in the evening."
    ),
    lambda r: (
        f"Extract the company names mentioned here:\n\n{r.choice(['Northwind', 'Bluepeak', 'Acme', 'Orbitel', 'Greenfield'])} signed a deal with {r.choice(['Solara', 'Kestrel Labs', 'Vantage', 'Tidewater'])}, and {r.choice(['Maple & Co', 'Brightline', 'Quanta'])} will supply the parts."
    ),
    lambda r: (
        f"Pull out the name, age and job of each person described:\n\n{_person(r)}, {r.randint(22, 70)}, works as a {r.choice(['nurse', 'pilot', 'teacher', 'baker', 'architect'])}. {_person(r)} is {r.randint(22, 70)} and runs a {r.choice(['bookshop', 'bakery', 'bike repair shop'])}."
    ),
    lambda r: (
        f"Extract the ingredients and their amounts from this recipe text as a list:\n\nMix {r.randint(100, 500)} g of flour, {r.randint(1, 4)} eggs and {r.randint(100, 300)} ml of milk. Add a pinch of salt and {r.randint(10, 50)} g of butter."
    ),
]
EXTRACTION_FOLLOWUPS = ["Now return the same information as a table.", "Did you miss anything? Check again."]

SENTENCES = [
    "Could you tell me where the nearest pharmacy is?",
    "I would like a table for two by the window.",
    "The meeting has been moved to next Tuesday.",
    "My favorite season is autumn because of the colors.",
    "We are planning a trip to the mountains this summer.",
    "Please turn off the lights when you leave the room.",
    "The museum is closed on Mondays.",
    "How long does it take to get to the airport by train?",
    "I forgot my umbrella at the office.",
    "She has been learning to play the piano for two years.",
    "The soup is too salty for me.",
    "Can I pay by card?",
    "We watched a great film last night.",
    "The children are playing in the garden.",
    "It is going to rain tomorrow afternoon.",
    "Thank you very much for your help.",
    "The bakery opens at seven in the morning.",
    "I need to buy a new pair of shoes.",
    "This book was more interesting than I expected.",
    "Our neighbors have a very friendly dog.",
    "Where can I buy a ticket for the bus?",
    "The train was delayed because of the snow.",
    "He always drinks tea with lemon.",
    "Let's meet in front of the cinema at eight.",
    "I am sorry, I do not understand.",
    "The hotel room has a view of the sea.",
    "We need more chairs for the party.",
    "My sister lives in a small village near the coast.",
    "The shop sells fresh fruit and vegetables.",
    "Could you speak more slowly, please?",
]
TARGETS = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
FOREIGN = [
    ("Spanish", "Mañana vamos a visitar a mis abuelos."),
    ("French", "Je voudrais un café, s'il vous plaît."),
    ("German", "Ich wohne seit drei Jahren in Berlin."),
    ("Italian", "La cena è pronta alle otto."),
    ("Portuguese", "O ônibus chega em dez minutos."),
    ("Dutch", "Ik fiets elke dag naar mijn werk."),
    ("Spanish", "¿Dónde está la estación de tren?"),
    ("French", "Nous avons passé un excellent week-end."),
    ("German", "Das Wetter ist heute sehr schön."),
    ("Italian", "Non vedo l'ora di rivederti."),
    ("Spanish", "El libro está encima de la mesa."),
    ("French", "Il fait trop chaud pour travailler."),
]
TRANSLATION_FOLLOWUPS = [
    "Now make it more formal.",
    "How would you say it in a casual way?",
    "Can you explain the grammar of your translation?",
]

QA_QUESTIONS = [
    "Why do leaves change color in autumn?",
    "How does a refrigerator keep food cold?",
    "What is the difference between a virus and a bacterium?",
    "Why do we have seasons on Earth?",
    "How do vaccines work?",
    "What causes thunder?",
    "Why is the ocean salty?",
    "How does a rainbow form?",
    "What is inflation, in simple terms?",
    "How do airplanes stay in the air?",
    "What is the difference between weather and climate?",
    "Why do cats purr?",
    "How does the heart pump blood?",
    "What is photosynthesis?",
    "Why does ice float on water?",
    "What is the difference between a planet and a star?",
    "How do bees make honey?",
    "What is a black hole?",
    "Why do we need sleep?",
    "How does a compass work?",
    "What is the greenhouse effect?",
    "How are mountains formed?",
    "What does a central bank do?",
    "Why do onions make people cry?",
    "How does GPS know where you are?",
    "What is DNA?",
    "Why is exercise good for the brain?",
    "How do solar panels make electricity?",
    "What is the difference between a lake and a sea?",
    "Why do some birds migrate?",
    "How does soap clean your hands?",
    "What is an earthquake?",
    "Why does bread rise?",
    "What is the difference between an ocean current and a tide?",
    "How do fish breathe underwater?",
    "What is a calorie?",
    "Why do stars twinkle?",
    "How does recycling paper work?",
    "What is the speed of sound, and why does it change?",
    "Why do we get goosebumps?",
    "How does a microwave oven heat food?",
    "What is the immune system?",
    "Why is the Moon sometimes visible during the day?",
    "What causes the northern lights?",
    "How do noise-cancelling headphones work?",
    "What is compound interest?",
    "Why do we yawn?",
    "How do plants know which way is up?",
    "What is the difference between a hurricane and a tornado?",
    "Why is biodiversity important?",
]
QA_TEMPLATES = [
    "{q}",
    "{q} Answer in two or three sentences.",
    "{q} Explain it as if to a twelve-year-old.",
    "In short: {q}",
    "{q} Give one everyday example.",
]
QA_FOLLOWUPS = ["Can you give me a simple example?", "Why is that important?", "Can you say that in one sentence?"]


def _person(r: random.Random) -> str:
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


def _date(r: random.Random) -> str:
    return f"{r.choice(MONTHS)} {r.randint(1, 28)}, {r.randint(2018, 2026)}"


def _email(r: random.Random) -> str:
    return f"{r.choice(FIRST).lower()}.{r.choice(LAST).lower()}@{r.choice(['example.com', 'mail.org', 'company.net'])}"


def single(r: random.Random, category: str) -> str:
    """One composed prompt of a category."""
    if category == "coding":
        if r.random() < 0.2:
            return r.choice(CODE_QUESTIONS)
        return r.choice(CODE_TEMPLATES).format(lang=r.choice(LANGS), task=r.choice(CODE_TASKS))
    if category == "math":
        return r.choice(MATH_TEMPLATES)(r)
    if category == "reasoning":
        return r.choice(REASONING_TEMPLATES)(r)
    if category == "writing":
        if r.random() < 0.3:
            who, what = r.choice(EMAILS)
            return f"Write a short, polite email to {who} about {what}."
        form = r.choice(FORMS)
        return f"Write {form} {'' if form.endswith('announcing') else 'about '}{r.choice(TOPICS)}.".replace("  ", " ")
    if category == "summarization":
        return r.choice(SUMMARY_TEMPLATES).format(p=r.choice(PASSAGES))
    if category == "extraction":
        return r.choice(EXTRACTION_TEMPLATES)(r)
    if category == "translation":
        if r.random() < 0.25:
            lang, text = r.choice(FOREIGN)
            return f'Translate this sentence from {lang} to English: "{text}"'
        template = r.choice(['Translate into {lang}: "{s}"', 'How do you say "{s}" in {lang}?'])
        return template.format(lang=r.choice(TARGETS), s=r.choice(SENTENCES))
    return r.choice(QA_TEMPLATES).format(q=r.choice(QA_QUESTIONS))


FOLLOWUPS = {
    "coding": CODE_FOLLOWUPS, "math": MATH_FOLLOWUPS, "reasoning": REASONING_FOLLOWUPS, "writing": WRITING_FOLLOWUPS,
    "summarization": SUMMARY_FOLLOWUPS, "extraction": EXTRACTION_FOLLOWUPS, "translation": TRANSLATION_FOLLOWUPS, "qa": QA_FOLLOWUPS,
}  # fmt: skip
REPLIES = {  # a previous assistant turn the follow-up refers to (short and generic, written for this file)
    "coding": "Here is a first version with a short explanation of how it works.",
    "math": "Let me work through it step by step and give the result at the end.",
    "reasoning": "Here is my reasoning, one step at a time, and the conclusion.",
    "writing": "Here is a draft. Let me know if you would like a different tone.",
    "summarization": "Here is a short summary of the main points.",
    "extraction": "Here is what I found in the text.",
    "translation": "Here is the translation.",
    "qa": "Here is a short explanation.",
}


def main() -> None:
    existing = [json.loads(line) for line in (DATA / "prompts-train.jsonl").read_text().splitlines()]
    seed_rows = [r for r in existing if r["question_id"].count("-") == 2 and int(r["question_id"].split("-")[2]) <= 32]
    val = {json.loads(line)["turns"][0] for line in (DATA / "prompts-val.jsonl").read_text().splitlines()}
    rows = []
    for category in FOLLOWUPS:
        r = random.Random(f"specdec-{category}")
        mine = [x for x in seed_rows if x["category"] == category]
        seen = {x["turns"][0] for x in mine} | val
        rows += mine
        n = len(mine)
        tries = 0
        while n < PER_CATEGORY and tries < 100_000:
            tries += 1
            text = single(r, category)
            if text in seen:
                continue
            seen.add(text)
            n += 1
            qid = f"train-{category}-{n:03d}"
            if r.random() < 0.1:  # a multi-turn conversation: the model answers the follow-up
                messages = [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": REPLIES[category]},
                    {"role": "user", "content": r.choice(FOLLOWUPS[category])},
                ]
                rows.append({"question_id": qid, "category": category, "messages": messages})
            else:
                rows.append({"question_id": qid, "category": category, "turns": [text]})
        if n < PER_CATEGORY:
            raise SystemExit(f"{category}: only {n} distinct prompts; add templates or topics")
    (DATA / "prompts-train.jsonl").write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in rows))
    print(f"wrote {len(rows)} prompts to {DATA / 'prompts-train.jsonl'}")


if __name__ == "__main__":
    main()
