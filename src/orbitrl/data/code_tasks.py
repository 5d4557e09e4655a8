"""The built-in code task: small Python problems with tests, scored by the ``code`` reward.

Two kinds of problem: programs that read stdin and print an answer (tests are
``{"input", "output"}`` pairs), and functions checked by ``{"assert": ...}`` snippets
appended to the program. Each problem carries a reference solution (the ``answer`` field,
used for supervised warm-up); a test runs every solution against its tests in the sandbox,
so the tests are known to be passable.

The prompt ends with an opening fence, so a completion is code followed by a closing fence
(the code reward extracts either form). Each problem also has a terse statement in the
``short`` field, for models whose context cannot hold the full one. The problems are shuffled once with a fixed seed
and cut into disjoint held-out and RL splits.
"""

from __future__ import annotations

import random


def _io(*pairs: tuple[str, str]) -> list[dict]:
    return [{"input": i, "output": o} for i, o in pairs]


def _asserts(*checks: str) -> list[dict]:
    return [{"assert": c} for c in checks]


# name -> (statement, tests, reference solution)
PROBLEMS: dict[str, tuple[str, list[dict], str]] = {
    "sum_two": ("Read two integers a and b on one line and print a + b.",
                _io(("3 4\n", "7\n"), ("-5 5\n", "0\n"), ("1000000 2345\n", "1002345\n")),
                "a, b = map(int, input().split())\nprint(a + b)\n"),
    "gcd": ("Read two positive integers on one line and print their greatest common divisor.",
            _io(("12 18\n", "6\n"), ("7 13\n", "1\n"), ("100 75\n", "25\n")),
            "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))\n"),
    "lcm": ("Read two positive integers on one line and print their least common multiple.",
            _io(("4 6\n", "12\n"), ("5 7\n", "35\n"), ("12 18\n", "36\n")),
            "import math\na, b = map(int, input().split())\nprint(a * b // math.gcd(a, b))\n"),
    "max_of_list": ("Read a line of integers and print the largest.",
                    _io(("3 9 2\n", "9\n"), ("-4 -2 -8\n", "-2\n"), ("5\n", "5\n")),
                    "print(max(map(int, input().split())))\n"),
    "reverse_string": ("Read a line of text and print it reversed.",
                       _io(("hello\n", "olleh\n"), ("abc def\n", "fed cba\n"), ("x\n", "x\n")),
                       "print(input()[::-1])\n"),
    "count_vowels": ("Read a line of lowercase text and print how many vowels (aeiou) it has.",
                     _io(("hello world\n", "3\n"), ("rhythm\n", "0\n"), ("aeiou\n", "5\n")),
                     "print(sum(c in 'aeiou' for c in input()))\n"),
    "factorial": ("Read n (0 <= n <= 20) and print n!.",
                  _io(("0\n", "1\n"), ("5\n", "120\n"), ("20\n", "2432902008176640000\n")),
                  "import math\nprint(math.factorial(int(input())))\n"),
    "fibonacci": ("Read n (0 <= n <= 90) and print the n-th Fibonacci number (F0 = 0, F1 = 1).",
                  _io(("0\n", "0\n"), ("1\n", "1\n"), ("10\n", "55\n"),
                      ("90\n", "2880067194370816120\n")),
                  "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\n"
                  "print(a)\n"),
    "is_prime": ("Read an integer n >= 1 and print YES if it is prime, else NO.",
                 _io(("2\n", "YES\n"), ("1\n", "NO\n"), ("97\n", "YES\n"), ("91\n", "NO\n")),
                 "n = int(input())\nok = n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))"
                 "\nprint('YES' if ok else 'NO')\n"),
    "sum_digits": ("Read a non-negative integer and print the sum of its digits.",
                   _io(("0\n", "0\n"), ("12345\n", "15\n"), ("9999\n", "36\n")),
                   "print(sum(map(int, input().strip())))\n"),
    "palindrome": ("Read a word and print YES if it reads the same backwards, else NO.",
                   _io(("level\n", "YES\n"), ("abca\n", "NO\n"), ("a\n", "YES\n")),
                   "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')\n"),
    "sort_numbers": ("Read a line of integers and print them sorted ascending, space-separated.",
                     _io(("3 1 2\n", "1 2 3\n"), ("5 -1 5 0\n", "-1 0 5 5\n"), ("7\n", "7\n")),
                     "print(*sorted(map(int, input().split())))\n"),
    "count_words": ("Read a line of text and print the number of words (separated by spaces).",
                    _io(("the quick brown fox\n", "4\n"), ("one\n", "1\n"),
                        ("  a  b  \n", "2\n")),
                    "print(len(input().split()))\n"),
    "fizzbuzz": ("Read n and print the numbers 1..n, one per line, but Fizz for multiples of 3, "
                 "Buzz for multiples of 5 and FizzBuzz for multiples of both.",
                 _io(("5\n", "1\n2\nFizz\n4\nBuzz\n"),
                     ("15\n", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\n"
                              "FizzBuzz\n")),
                 "for i in range(1, int(input()) + 1):\n"
                 "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else "
                 "'Buzz' if i % 5 == 0 else i)\n"),
    "sum_n_lines": ("The first line holds n; n integers follow, one per line. Print their sum.",
                    _io(("3\n1\n2\n3\n", "6\n"), ("1\n-7\n", "-7\n"), ("0\n", "0\n")),
                    "n = int(input())\nprint(sum(int(input()) for _ in range(n)))\n"),
    "binary": ("Read a non-negative integer and print it in binary, without a prefix.",
               _io(("0\n", "0\n"), ("5\n", "101\n"), ("255\n", "11111111\n")),
               "print(bin(int(input()))[2:])\n"),
    "from_binary": ("Read a binary number and print its value in decimal.",
                    _io(("0\n", "0\n"), ("101\n", "5\n"), ("11111111\n", "255\n")),
                    "print(int(input(), 2))\n"),
    "min_max": ("Read a line of integers and print the smallest and the largest, "
                "separated by a space.",
                _io(("3 9 2\n", "2 9\n"), ("4\n", "4 4\n"), ("-1 -9 0\n", "-9 0\n")),
                "xs = list(map(int, input().split()))\nprint(min(xs), max(xs))\n"),
    "average": ("Read a line of integers and print their mean with exactly two decimals.",
                _io(("1 2\n", "1.50\n"), ("3 3 3\n", "3.00\n"), ("1 2 2\n", "1.67\n")),
                "xs = list(map(int, input().split()))\nprint(f'{sum(xs) / len(xs):.2f}')\n"),
    "uppercase": ("Read a line of text and print it in upper case.",
                  _io(("hello\n", "HELLO\n"), ("Mixed Case 1\n", "MIXED CASE 1\n")),
                  "print(input().upper())\n"),
    "char_count": ("Read a word and a single character on two lines; print how many times the "
                   "character occurs in the word.",
                   _io(("banana\na\n", "3\n"), ("apple\nz\n", "0\n"), ("aaaa\na\n", "4\n")),
                   "w = input()\nc = input()\nprint(w.count(c))\n"),
    "triangle": ("Read n and print a right triangle of stars: line i (1..n) has i stars.",
                 _io(("1\n", "*\n"), ("3\n", "*\n**\n***\n")),
                 "for i in range(1, int(input()) + 1):\n    print('*' * i)\n"),
    "even_sum": ("Read a line of integers and print the sum of the even ones.",
                 _io(("1 2 3 4\n", "6\n"), ("1 3 5\n", "0\n"), ("-2 2 10\n", "10\n")),
                 "print(sum(x for x in map(int, input().split()) if x % 2 == 0))\n"),
    "power_mod": ("Read a, b and m on one line and print a to the power b modulo m.",
                  _io(("2 10 1000\n", "24\n"), ("3 0 7\n", "1\n"), ("7 222 13\n", "12\n")),
                  "a, b, m = map(int, input().split())\nprint(pow(a, b, m))\n"),
    "distinct_count": ("Read a line of integers and print how many distinct values it holds.",
                       _io(("1 2 2 3\n", "3\n"), ("5 5 5\n", "1\n"), ("1 2 3\n", "3\n")),
                       "print(len(set(input().split())))\n"),
    "second_largest": ("Read a line of at least two distinct integers and print the second "
                       "largest distinct value.",
                       _io(("3 9 2\n", "3\n"), ("5 5 4\n", "4\n"), ("-1 -2\n", "-2\n")),
                       "xs = sorted(set(map(int, input().split())))\nprint(xs[-2])\n"),
    "f_add": ("Write a Python function add(a, b) that returns a + b.",
              _asserts("assert add(2, 3) == 5", "assert add(-1, 1) == 0",
                       "assert add(10**12, 1) == 10**12 + 1"),
              "def add(a, b):\n    return a + b\n"),
    "f_is_even": ("Write a Python function is_even(n) that returns True when n is even.",
                  _asserts("assert is_even(4) is True", "assert is_even(7) is False",
                           "assert is_even(0) is True"),
                  "def is_even(n):\n    return n % 2 == 0\n"),
    "f_reverse_words": ("Write a Python function reverse_words(s) that returns the words of s "
                        "in reverse order, joined by single spaces.",
                        _asserts("assert reverse_words('a b c') == 'c b a'",
                                 "assert reverse_words('hello') == 'hello'",
                                 "assert reverse_words('one  two') == 'two one'"),
                        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n"),
    "f_flatten": ("Write a Python function flatten(xss) that returns the items of a list of "
                  "lists as one list.",
                  _asserts("assert flatten([[1, 2], [3]]) == [1, 2, 3]",
                           "assert flatten([]) == []", "assert flatten([[], [4]]) == [4]"),
                  "def flatten(xss):\n    return [x for xs in xss for x in xs]\n"),
    "f_count_chars": ("Write a Python function count_chars(s) that returns a dict from each "
                      "character of s to its number of occurrences.",
                      _asserts("assert count_chars('abca') == {'a': 2, 'b': 1, 'c': 1}",
                               "assert count_chars('') == {}"),
                      "def count_chars(s):\n    out = {}\n    for c in s:\n"
                      "        out[c] = out.get(c, 0) + 1\n    return out\n"),
    "f_clamp": ("Write a Python function clamp(x, lo, hi) that returns x limited to [lo, hi].",
                _asserts("assert clamp(5, 0, 3) == 3", "assert clamp(-2, 0, 3) == 0",
                         "assert clamp(2, 0, 3) == 2"),
                "def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n"),
    "f_dedupe": ("Write a Python function dedupe(xs) that returns xs without repeated items, "
                 "keeping the first occurrence of each, in order.",
                 _asserts("assert dedupe([1, 2, 1, 3, 2]) == [1, 2, 3]",
                          "assert dedupe([]) == []", "assert dedupe(['a', 'a']) == ['a']"),
                 "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n"
                 "        if x not in seen:\n            seen.add(x)\n            out.append(x)\n"
                 "    return out\n"),
    "f_digits": ("Write a Python function digits(n) that returns the list of decimal digits of "
                 "a non-negative integer n, most significant first.",
                 _asserts("assert digits(0) == [0]", "assert digits(507) == [5, 0, 7]"),
                 "def digits(n):\n    return [int(c) for c in str(n)]\n"),
    "f_is_anagram": ("Write a Python function is_anagram(a, b) that returns True when the two "
                     "words use the same letters the same number of times.",
                     _asserts("assert is_anagram('listen', 'silent')",
                              "assert not is_anagram('abc', 'abd')",
                              "assert not is_anagram('aab', 'ab')"),
                     "def is_anagram(a, b):\n    return sorted(a) == sorted(b)\n"),
}

# Terse statements (``short`` field) for models with a tiny context, such as the built-in
# 64-token model: select them with data.prompt_field=short.
SHORT: dict[str, str] = {
    "sum_two": "stdin a b; print a+b", "gcd": "stdin a b; print gcd",
    "lcm": "stdin a b; print lcm", "max_of_list": "stdin ints; print max",
    "reverse_string": "stdin s; print s reversed", "count_vowels": "stdin s; print #vowels",
    "factorial": "stdin n; print n!", "fibonacci": "stdin n; print fib(n)",
    "is_prime": "stdin n; print YES if prime else NO", "sum_digits": "stdin n; print digit sum",
    "palindrome": "stdin s; print YES if palindrome else NO",
    "sort_numbers": "stdin ints; print sorted", "count_words": "stdin s; print #words",
    "fizzbuzz": "stdin n; print fizzbuzz 1..n", "sum_n_lines": "stdin n then n ints; print sum",
    "binary": "stdin n; print n in binary", "from_binary": "stdin binary; print decimal",
    "min_max": "stdin ints; print min max", "average": "stdin ints; print mean .2f",
    "uppercase": "stdin s; print upper", "char_count": "stdin s, c; print s.count(c)",
    "triangle": "stdin n; print star triangle", "even_sum": "stdin ints; print even sum",
    "power_mod": "stdin a b m; print a^b mod m", "distinct_count": "stdin ints; print #distinct",
    "second_largest": "stdin ints; print 2nd largest", "f_add": "def add(a,b): a+b",
    "f_is_even": "def is_even(n)", "f_reverse_words": "def reverse_words(s)",
    "f_flatten": "def flatten(xss)", "f_count_chars": "def count_chars(s) -> dict",
    "f_clamp": "def clamp(x,lo,hi)", "f_dedupe": "def dedupe(xs) keep order",
    "f_digits": "def digits(n) -> list", "f_is_anagram": "def is_anagram(a,b)",
}

SPLITS = {"heldout": (0, 10), "rl": (10, None), "sft": (10, None)}


def _prompt(statement: str) -> str:
    return f"{statement}\nAnswer with Python code only.\n```python\n"


def _short(name: str) -> str:
    return f"{SHORT[name]}\n```python\n"


def code_rows(split: str, limit: int | None = None) -> list[dict]:
    """Rows ``{"prompt", "short", "answer" (reference solution), "tests", "name"}`` of one
    split, in a fixed order. ``sft`` is the RL split (its answers are the supervised
    targets)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    names = sorted(PROBLEMS)
    random.Random(1234).shuffle(names)
    lo, hi = SPLITS[split]
    rows = []
    for name in names[lo:hi]:
        statement, tests, solution = PROBLEMS[name]
        rows.append({"prompt": _prompt(statement), "short": _short(name),
                     "answer": solution + "```", "tests": tests, "name": name})
    return rows[:limit] if limit else rows
