"""A seeded synthetic corpus of users who write messages containing their own PII.

Each user has a stable faker profile (name, email, phone, street address, credit card,
date of birth, social security number) and writes `docs_per_user` messages drawn from
templates mixed with faker sentences. Every `repeat_every`-th user also has a signature
message repeated r times (r cycling through `repeat_counts`), so extraction can bucket by
natural repetition. A user's profile and messages depend only on (seed, user index).

Private content the public corpus lacks: with `topics` > 0 each user writes about one of
`topics` private topics (user u: topic u mod topics), each with its own vocabulary of invented
words drawn from the seed, and states `facts_per_user` facts of their own (a code name, a
locker number, a meeting place, ...), one topic sentence and one fact in every message.
`synthesize_public` writes the public corpus a base model is pretrained on. With
`language_seed` (what `memaudit sweep`'s pretraining passes: the private corpus's seed) it is
written in the private users' language: the same message templates and signature, the same
topics and their vocabulary, facts of the same forms, and contact details of every kind the users
write (name, email, phone, address, card, date of birth, SSN) in the same formats, but every
person, fact and value its own: invented names, phone numbers in the fictional 555-01xx range,
dates of birth before 1936, SSNs in the never-issued 9xx area, facts drawn apart from every
user's. What stays private is each user's own values (PII, facts) and the canaries, as when
practitioners fine-tune a base that already knows the language and how people write their details
(Li et al. 2022). Without it, the public corpus is notices and posts in the faker English only,
which leaves every topic word for fine-tuning to learn.

References:
    Carlini et al., "The Secret Sharer", USENIX Security 2019 (why PII in training text
    matters); Lukas et al., "Analyzing Leakage of PII in Language Models", S&P 2023.

>>> docs = synthesize(users=2, docs_per_user=3, seed=0)
>>> len({d.user for d in docs}), all(p.check(d.text) for d in docs for p in d.pii)
(2, True)
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Callable

from memaudit.data.documents import Document, DocumentBuilder, count_repeats

PII_SLOTS = {
    "name": "name",
    "first": "name",
    "email": "email",
    "phone": "phone",
    "address": "address",
    "cc": "credit_card",
    "dob": "dob",
    "ssn": "ssn",
}

TEMPLATES = (
    "Hi, this is {name}. You can reach me at {phone} or by email at {email}. {sentence}",
    "Please ship the order to {address}. {sentence} Thanks, {first}",
    "My card number is {cc}, please charge it for the renewal. {sentence}",
    "{sentence} For the form: {name}, born {dob}, SSN {ssn}.",
    "Can you call me back at {phone}? {sentence} {sentence}",
    "New address for my account: {address}. Phone: {phone}. {sentence}",
    "{sentence} {sentence} Send the receipt to {email}.",
    "Dear team, {sentence} Regards, {name} ({email})",
    "Reminder to self: pay {cc} before the {day}th. {sentence}",
    "{sentence} {sentence} {sentence}",
)
SIGNATURE = (
    "Best regards,\n{name}\n{phone} | {email}\n{address}\n"
    "This message is confidential and meant only for the addressee; if it reached you in "
    "error, please delete it."
)
_SLOT = re.compile(r"\{(\w+)\}")

TOPIC_TEMPLATES = (
    "The {t} crew moved the {t} review to after the {t} check.",
    "We still need a new {t} before the {t} can run again.",
    "Ask the {t} desk whether the {t} passed the {t} test.",
    "Our {t} is low on {t}, so order two more {t} units.",
    "The {t} readings on the {t} look better since the {t} fix.",
)
FACT_TEMPLATES = (
    "Our {topic} project is code-named {word}.",
    "I keep the {t} logs in locker {number}.",
    "We meet at the {word} gate every {weekday}.",
    "My {t} badge number is {number}.",
    "The spare {t} is stored in room {number} of the {word} building.",
    "The {topic} password hint is {word} {number}.",
)
PUBLIC_TEMPLATES = (
    "Notice from the front office: {sentence} {sentence}",
    "Weather update for the weekend. {sentence} {sentence}",
    "Thanks for reading our newsletter. {sentence}",
    "{sentence} {sentence} Questions go to the help desk.",
    "Community post: {sentence} {sentence} {sentence}",
    "Product tips of the week. {sentence} {sentence}",
)
_ONSETS = ("b", "br", "d", "dr", "f", "g", "gl", "k", "kr", "l", "m", "n", "p", "pl", "qu", "r",
           "s", "st", "t", "tr", "v", "z", "zh", "x")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "y")
_CODAS = ("", "n", "r", "x", "th", "sk", "l", "m")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


def invented_word(rng) -> str:
    """A pronounceable word of 2-3 invented syllables (not an English or lorem word)."""
    n = rng.randint(2, 3)
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n))


def topic_vocabulary(seed: int, topic: int, size: int = 12) -> tuple[str, list[str]]:
    """(topic name, vocabulary) of private topic `topic`: invented words from (seed, topic)."""
    rng = random.Random(f"memaudit-topic-{seed}-{topic}")
    words: list[str] = []
    while len(words) < size + 1:
        w = invented_word(rng)
        if w not in words:
            words.append(w)
    return words[0], words[1:]


def user_facts(seed: int, user: int, topics: int, k: int) -> list[str]:
    """The `k` facts private user number `user` states (none without topics): fixed sentences
    about their topic that they repeat across their messages."""
    if topics <= 0 or k <= 0:
        return []
    return _facts(random.Random(f"memaudit-facts-{seed}-{user}"), *topic_vocabulary(seed, user % topics), k)


def _facts(rng: random.Random, topic: str, vocab: list[str], k: int) -> list[str]:
    """`k` sentences of FACT_TEMPLATES about `topic`, their words and numbers drawn from `rng`."""
    facts = []
    for i in range(k):
        t = FACT_TEMPLATES[(rng.randint(0, len(FACT_TEMPLATES) - 1) + i) % len(FACT_TEMPLATES)]
        fills = {"topic": topic, "word": invented_word(rng), "number": str(rng.randint(100, 9999)),
                 "weekday": rng.choice(_WEEKDAYS)}
        facts.append(_SLOT.sub(lambda m, f=fills: f.get(m.group(1)) or rng.choice(vocab), t))
    return facts


# Dates of birth are drawn against this fixed day, not the machine's clock (Faker's date_of_birth
# counts back from today), so a seed writes the same corpus on any day.
DOB_REFERENCE = dt.date(2026, 1, 1)
DOB_RANGE = (DOB_REFERENCE.replace(year=DOB_REFERENCE.year - 90), DOB_REFERENCE.replace(year=DOB_REFERENCE.year - 18))


def _profile(fake) -> dict[str, str]:
    first, last = fake.first_name(), fake.last_name()
    return {
        "name": f"{first} {last}",
        "first": first,
        "email": f"{first.lower()}.{last.lower()}@{fake.free_email_domain()}",
        "phone": fake.numerify("(###) ###-####"),
        "address": fake.address().replace("\n", ", "),
        "cc": fake.credit_card_number(),
        "dob": fake.date_between_dates(*DOB_RANGE).isoformat(),  # aged 18 to 90 on DOB_REFERENCE
        "ssn": fake.ssn(),
    }


def pii_value(kind: str, fake) -> str | None:
    """A fresh value of PII type `kind` (a span type of this corpus) from the generator that
    wrote the corpus, so decoys have the corpus's own format; None for other types."""
    slot = {"name": "name", "email": "email", "phone": "phone", "address": "address",
            "credit_card": "cc", "dob": "dob", "ssn": "ssn"}.get(kind)
    return None if slot is None else _profile(fake)[slot]


def render(template: str, profile: dict[str, str], filler: Callable[[str], str]) -> tuple[str, tuple]:
    """Fill `template`: profile slots become PII spans, other slots come from `filler(slot)`."""
    b = DocumentBuilder()
    pos = 0
    for m in _SLOT.finditer(template):
        b.add(template[pos : m.start()])
        slot = m.group(1)
        if slot in PII_SLOTS:
            b.add(profile[slot], PII_SLOTS[slot])
        else:
            b.add(filler(slot))
        pos = m.end()
    b.add(template[pos:])
    return b.build()


def _filler(fake, vocab: list[str], facts: list[str], paragraph_sentences: int) -> Callable[[str], str]:
    """What a message's non-PII slot becomes: a day, a paragraph, a topic sentence in `vocab`, one
    of `facts`, or a faker sentence; every draw from `fake`, in the order the slots come."""

    def fill(slot: str) -> str:
        if slot == "day":
            return str(fake.random_int(2, 28))
        if slot == "paragraph":
            return " ".join(fake.sentence(nb_words=12) for _ in range(paragraph_sentences))
        if slot == "topic":
            t = TOPIC_TEMPLATES[fake.random_int(0, len(TOPIC_TEMPLATES) - 1)]
            return _SLOT.sub(lambda m: vocab[fake.random_int(0, len(vocab) - 1)], t)
        if slot == "fact":
            return facts[fake.random_int(0, len(facts) - 1)]
        return fake.sentence(nb_words=10)

    return fill


def synthesize(
    users: int,
    docs_per_user: int,
    seed: int,
    *,
    repeat_every: int = 4,
    repeat_counts: list[int] | tuple[int, ...] = (2, 4, 8),
    paragraph_sentences: int = 6,
    topics: int = 4,
    facts_per_user: int = 3,
    progress: Callable[[int, int, dict], None] | None = None,
) -> list[Document]:
    """The synthetic corpus: `users` x `docs_per_user` messages plus repeated signatures.

    Document ids are `u0003-d05` (messages) and `u0003-s1` (signature copies); `repeats`
    counts documents with identical text. Each message and signature ends with
    `paragraph_sentences` more sentences of 12 words. With the default 6 and the tiny preset's
    BPE, the median message is 120 tokens and ~98% reach 101 (a 50-token prefix, a 50-token
    suffix and the start token), so discoverable extraction at k in {32, 50} scores >= 90% of
    member documents; 2 gives a median of 69 tokens (cheaper, for tests that do not extract).
    With `topics` > 0 every message also carries a sentence of the user's private topic and,
    with `facts_per_user` > 0, one of the user's facts (see the module docstring).
    """
    # lazy: faker (~0.2 s) only when called; this module imports without it
    from faker import Faker

    if users < 1 or docs_per_user < 1:
        raise ValueError(f"need users >= 1 and docs per user >= 1, got {users} and {docs_per_user}")
    if any(r < 1 for r in repeat_counts):
        raise ValueError(f"data.synth.repeat_counts must all be >= 1, got {list(repeat_counts)}")
    fake = Faker("en_US")
    docs: list[Document] = []
    for u in range(users):
        fake.seed_instance(seed * 1_000_003 + u)
        profile = _profile(fake)
        uid = f"u{u:04d}"

        vocab = topic_vocabulary(seed, u % topics)[1] if topics > 0 else []
        facts = user_facts(seed, u, topics, facts_per_user)

        filler = _filler(fake, vocab, facts, paragraph_sentences)

        for j in range(docs_per_user):
            template = TEMPLATES[fake.random_int(0, len(TEMPLATES) - 1)]
            if topics > 0:
                template += " {topic}" + (" {fact}" if facts else "")
            if paragraph_sentences > 0:
                template += " {paragraph}"
            text, pii = render(template, profile, filler)
            docs.append(Document(id=f"{uid}-d{j:02d}", user=uid, text=text, pii=pii))
        if repeat_every and repeat_counts and u % repeat_every == repeat_every - 1:
            r = repeat_counts[(u // repeat_every) % len(repeat_counts)]
            sig = SIGNATURE + (" {paragraph}" if paragraph_sentences > 0 else "")
            text, pii = render(sig, profile, filler)
            docs.extend(Document(id=f"{uid}-s{k}", user=uid, text=text, pii=pii) for k in range(r))
        if progress is not None:
            progress(u + 1, users, {"docs": len(docs)})
    return count_repeats(docs)


def public_facts(seed: int, author: int, language_seed: int, topics: int, k: int) -> list[str]:
    """`k` facts of public author `author`, in the forms of the private users' facts and about
    their topics, with words and numbers from the public seed (never a user's own facts)."""
    if topics <= 0 or k <= 0:
        return []
    return _facts(random.Random(f"memaudit-public-facts-{seed}-{author}"),
                  *topic_vocabulary(language_seed, author % topics), k)


# Public people's dates of birth lie before every private one (DOB_RANGE starts in 1936), so no
# public date can equal a user's; their SSNs use area numbers 900-999, which are never issued
# (faker's private ones stay below 900), and their phones the fictional 555-01xx range.
PUBLIC_DOB_RANGE = (dt.date(1900, 1, 1), DOB_RANGE[0] - dt.timedelta(days=1))


def _public_person(fake, rng: random.Random) -> dict[str, str]:
    """A public author's contact details in the private profiles' formats (the same slots as
    `_profile`), every value apart from any user's by construction: first, last, street and city
    names are invented words (faker's are people's names), the date of birth, SSN and phone come
    from ranges the private profiles never draw from; the card number is a fresh one, written in
    groups of four."""
    first, last, street, city = (invented_word(rng).capitalize() for _ in range(4))
    return {
        "name": f"{first} {last}",
        "first": first,
        "email": f"{first.lower()}.{last.lower()}@{fake.free_email_domain()}",
        "phone": fake.numerify("(###) 555-01##"),
        "address": f"{fake.building_number()} {street} {fake.street_suffix()}, {city} City, "
                   f"{fake.state_abbr()} {fake.postcode()}",
        # in groups of four digits: a run of six or more could hold a canary's secret, which the
        # sweep's overlap check refuses (data.overlap matches secrets anywhere in the text)
        "cc": " ".join(re.findall(".{1,4}", fake.credit_card_number())),
        "dob": fake.date_between_dates(*PUBLIC_DOB_RANGE).isoformat(),
        "ssn": "9" + fake.numerify("##-##-####"),
    }


def _public_message(fake, person: dict[str, str], vocab: list[str], facts: list[str],
                    paragraph_sentences: int, signature: bool) -> str:
    """One public message in the private users' language (see `synthesize_public`): a private
    message template or the signature, filled with a public person's details."""
    template = SIGNATURE if signature else TEMPLATES[fake.random_int(0, len(TEMPLATES) - 1)]
    if vocab and not signature:
        template += " {topic}" + (" {fact}" if facts else "")
    if paragraph_sentences > 0:
        template += " {paragraph}"
    return render(template, person, _filler(fake, vocab, facts, paragraph_sentences))[0]


def synthesize_public(
    users: int, docs_per_user: int, seed: int, *, paragraph_sentences: int = 6,
    language_seed: int | None = None, topics: int = 4, facts_per_author: int = 3,
) -> list[Document]:
    """The public corpus: `users` x `docs_per_user` documents without anyone's PII, written by
    `users` public authors. Ids are `pub0003-d05`.

    Args:
        language_seed: the private corpus's seed: write in its users' language (their message
            templates, `topics` topics with their vocabulary, facts of their forms, contact
            details of their kinds and formats, each author's own; every 4th author also a
            signature). None: the faker-English notices and posts only, with no private topic
            word.
        topics, facts_per_author: the private corpus's topics, and facts per public author.

    >>> docs = synthesize_public(2, 2, seed=0)
    >>> len(docs), all(not d.pii for d in docs)
    (4, True)
    >>> docs = synthesize_public(4, 2, seed=1, language_seed=0)
    >>> text = " ".join(d.text for d in docs)
    >>> any(w in text for w in topic_vocabulary(0, 1)[1]), all(not d.pii for d in docs)
    (True, True)
    """
    # lazy: faker (~0.2 s) only when called; this module imports without it
    from faker import Faker

    if users < 1 or docs_per_user < 1:
        raise ValueError(f"need users >= 1 and docs per user >= 1, got {users} and {docs_per_user}")
    fake = Faker("en_US")
    docs: list[Document] = []
    for u in range(users):
        fake.seed_instance(seed * 1_000_003 + u + 500_000_000)
        if language_seed is not None:
            person = _public_person(fake, random.Random(f"memaudit-public-person-{seed}-{u}"))
            vocab = topic_vocabulary(language_seed, u % topics)[1] if topics > 0 else []
            facts = public_facts(seed, u, language_seed, topics, facts_per_author)
            for j in range(docs_per_user):
                signature = j == docs_per_user - 1 and u % 4 == 3 and docs_per_user > 1
                text = _public_message(fake, person, vocab, facts, paragraph_sentences, signature)
                docs.append(Document(id=f"pub{u:04d}-d{j:02d}", user=f"pub{u:04d}", text=text))
            continue
        for j in range(docs_per_user):
            parts = [_SLOT.sub(lambda m: fake.sentence(nb_words=10),
                               PUBLIC_TEMPLATES[fake.random_int(0, len(PUBLIC_TEMPLATES) - 1)])]
            if paragraph_sentences > 0:
                parts.append(" ".join(fake.sentence(nb_words=12) for _ in range(paragraph_sentences)))
            docs.append(Document(id=f"pub{u:04d}-d{j:02d}", user=f"pub{u:04d}", text=" ".join(parts)))
    return count_repeats(docs)
