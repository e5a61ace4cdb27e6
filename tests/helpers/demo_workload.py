"""The demo loop's workload (tests/helpers/demo_loop.py), apart from the loop itself: the test modules that check
it import these at collection, without the loop's imports (openai, Serve)."""

K = 3
WORKLOAD = [  # a narrow workload: every prompt comes back several times (a held-out request repeats one)
    "def parse_config(path):",
    "SELECT name FROM users WHERE",
    "import numpy as np\n",
    "class Stack:\n    def push(self, x):",
    "The capital of France is",
    "for i in range(10):",
    "git commit -m",
    "Dear customer, thank you for",
]
REPEATS = 3
TOKENS = 16
DEMO_REQUESTS = 4  # the demo's own workload (builtin-coding chats), recorded beside the narrow one
