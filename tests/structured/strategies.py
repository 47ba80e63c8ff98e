"""Hypothesis strategies for constraints whose every instance is finite, so a random model
sampling at temperature 1 always reaches the end of the grammar: strings carry maxLength or a
bounded pattern, integers bounds, arrays maxItems, objects no additional properties."""
import string

from hypothesis import strategies as st

PATTERNS = [r"^[a-z]{1,8}$", r"^[A-Z][a-z]{0,5}$", r"^\d{3}-\d{2}$", r"^(foo|bar)[0-9]?$",
            r"^[a-f0-9]{4}$"]
NAMES = st.text(string.ascii_lowercase + "_", min_size=1, max_size=8)
# Any assigned character. Planes 4-11 hold none, and SmolLM2's byte-level vocabulary has no
# token for their UTF-8 lead bytes (0xF1, 0xF2), nor for some control bytes: a constant
# made of them cannot be produced.
CHARS = st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc"))


@st.composite
def bounded_strings(draw):
    schema = {"type": "string"}
    kind = draw(st.sampled_from(["length", "pattern", "enum"]))
    if kind == "pattern":
        schema["pattern"] = draw(st.sampled_from(PATTERNS))
    elif kind == "enum":
        return {"enum": draw(st.lists(st.text(CHARS, min_size=1, max_size=6), min_size=1, max_size=4,
                                      unique=True))}
    else:
        schema["maxLength"] = draw(st.integers(0, 12))
        schema["minLength"] = draw(st.integers(0, schema["maxLength"]))
    return schema


@st.composite
def bounded_integers(draw):
    low = draw(st.integers(-10**6, 10**6))
    return {"type": "integer", "minimum": low, "maximum": low + draw(st.integers(0, 10**4))}


LEAVES = st.one_of(bounded_strings(), bounded_integers(), st.just({"type": "boolean"}),
                   st.just({"type": "null"}),
                   st.integers(-5, 5).map(lambda v: {"const": v}),
                   st.lists(st.sampled_from([1.5, -2, "x", True, None]), min_size=1, max_size=3,
                            unique_by=repr).map(lambda vs: {"enum": vs}))


@st.composite
def arrays(draw, items):
    low = draw(st.integers(0, 2))
    return {"type": "array", "items": draw(items), "minItems": low,
            "maxItems": low + draw(st.integers(0, 2))}


@st.composite
def objects(draw, values):
    props = draw(st.dictionaries(NAMES, values, min_size=1, max_size=4))
    required = [k for k in props if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def json_schemas():
    nested = st.recursive(LEAVES, lambda children: st.one_of(
        arrays(children), objects(children),
        st.lists(children, min_size=2, max_size=3).map(lambda cs: {"anyOf": cs})), max_leaves=6)
    return objects(nested)


@st.composite
def regexes(draw):
    """Concatenations of bounded pieces: literals, classes with {m,n}, alternations."""
    pieces = draw(st.lists(st.one_of(
        st.text(string.ascii_letters + string.digits, min_size=1, max_size=3),
        st.builds(lambda cls, lo, extra: f"[{cls}]{{{lo},{lo + extra}}}",
                  st.sampled_from(["a-z", "0-9", "A-F", "xyz"]), st.integers(0, 3),
                  st.integers(0, 3)),
        st.lists(st.text(string.ascii_lowercase, min_size=1, max_size=4), min_size=2,
                 max_size=3, unique=True).map(lambda alts: "(" + "|".join(alts) + ")")),
        min_size=1, max_size=5))
    return "".join(pieces)


CHOICES = st.lists(st.text(CHARS, min_size=1, max_size=10), min_size=1, max_size=6, unique=True)
