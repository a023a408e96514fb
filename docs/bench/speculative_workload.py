"""The prompts of ``speculative.py``: a workload whose answers quote their prompts (the
n-gram proposer's case: editing, summarising, code), and an open-ended one (stories:
little to look up).

The first three are short (a paragraph, a ten-line function): the demo model rewrites
more of them than it keeps. The last two hand it longer inputs to keep most of (a letter
to correct, a 17-line module to rename a variable in), as editing requests usually do."""
PARAGRAPH = ("The comittee met on tuesday to discus the new budjet. After a long debate, "
             "they agreed to fund the libary renovation and to hire two more teachers for "
             "the primary school, starting in september.")
FUNCTION = ("def moving_average(values, window):\n    out = []\n    total = 0\n"
            "    for i, v in enumerate(values):\n        total += v\n"
            "        if i >= window:\n            total -= values[i - window]\n"
            "        if i >= window - 1:\n            out.append(total / window)\n"
            "    return out\n")
LETTER = ("Dear Anna, thank you for your leter. We have recieved the documents and we will "
          "send them to the acountant next week. The meeting with the bank is on thursday at "
          "ten o'clock, and I hope you can join us. Please bring the contract and the "
          "reciepts from march. Best regards, Tom.")
MODULE = '''def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def merge_configs(base, override):
    result = dict(base)
    for key, value in override.items():
        result[key] = value
    return result
'''
WORKLOAD = {
    "edit": f"Fix the spelling mistakes in the following text. Reply with the corrected text "
            f"only.\n\nText: {PARAGRAPH} The new teachers will start in septmber and the "
            f"libary will reopen in october.",
    "summarise": f"Here is a text:\n\n{PARAGRAPH}\n\nSummarise it in one sentence, reusing "
                 f"its words.",
    "code": f"Rename the variable `total` to `running_sum` in this function. Reply with the "
            f"full function.\n\n```python\n{FUNCTION}```",
    "letter": f"Correct the spelling in this letter. Reply with the corrected letter only."
              f"\n\n{LETTER}",
    "module": f"Rename the variable `settings` to `config` in this code. Reply with the full "
              f"code.\n\n```python\n{MODULE}```",
}
OPEN = ["Write a short story about a lighthouse keeper.", "Tell me a tale of two rivers.",
        "Write a poem about the first snow.", "Describe a city in the year 3000."]
