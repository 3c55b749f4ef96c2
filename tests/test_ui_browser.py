"""The Prefect UI in a real browser: the run form a data engineer fills in for the on-demand
deployment (generated from JobSpec's JSON schema), and what the run then shows.

A Prefect server with its UI on 127.0.0.1, the pools and deployments of infra/ and
deployments/prefect.yaml, one process worker on the CPU pool, and Debian's headless Chromium
driven through Selenium and the system chromedriver (installed with apt-get here when missing;
nothing is downloaded at test time). Every wait is bounded.

Screenshots go to $TOKENMILL_UI_SCREENSHOTS, else to the test's temporary folder;
`make ui-screenshots` copies two of them to docs/img/ for the README.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import write_parquet
from test_fleet import WORDS, Fleet, _wait_for, deploy
from tokenmill.spec import DTYPES, QUANTIZATIONS, GenerationParams

pytestmark = [pytest.mark.browser, pytest.mark.fleet]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_PACKAGES = ("chromium", "chromium-driver", "fonts-liberation")  # fonts: readable screenshots
WIDTH = 1280
ROWS, SHARD_ROWS = 40, 10
# A free-form mapping (engine_kwargs, storage_options, ...) is edited as JSON; nothing else may be.
FREE_FORM = "free-form"


# --- the browser: Debian's Chromium and chromedriver ---------------------------------------------

def _install_chromium() -> None:
    """apt-get install Chromium and its driver where they are missing; skip only without apt."""
    if os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER):
        return
    if shutil.which("apt-get") is None:
        pytest.skip(f"no {CHROMIUM} and {CHROMEDRIVER}, and no apt-get to install "
                    f"{' '.join(BROWSER_PACKAGES)} with: the browser test needs Debian's Chromium")
    sudo: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None or subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode:
            pytest.skip(f"no {CHROMIUM}: apt-get install {' '.join(BROWSER_PACKAGES)} needs root, "
                        "and this user is not root and has no password-less sudo")
        sudo = ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=120"]
    for command, timeout in (([*sudo, "apt-get", *lock, "update"], 300),
                             ([*sudo, "apt-get", *lock, "install", "-y", "--no-install-recommends",
                               *BROWSER_PACKAGES], 600)):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{' '.join(command)} took over {timeout} s")
        assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-2000:]}\n" \
                                     f"{done.stderr[-2000:]}"
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), "apt-get installed no chromium/chromedriver"


@pytest.fixture(scope="module")
def browser():
    _install_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WIDTH},1000", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the API's answers the page logs (_submit)
    # the system chromedriver, named: Selenium Manager would download one
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(90)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = os.environ.get("TOKENMILL_UI_SCREENSHOTS")
    path = Path(folder).resolve() if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- the server, its deployments and a CPU worker ---------------------------------------------

@pytest.fixture(scope="module")
def ui(tmp_path_factory, browser):
    """A Prefect server with its UI, deployments/prefect.yaml applied, and one process worker on
    the CPU pool (the on-demand deployment's)."""
    fleet = Fleet(tmp_path_factory.mktemp("ui"), ui=True)
    try:
        fleet.start("server", "start", "--host", "127.0.0.1", "--port", str(fleet.port), log="server.log")
        fleet.wait_healthy()
        on_demand = deploy(fleet)
        fleet.start("worker", "start", "--pool", "tokenmill-cpu", "--type", "process", "--name", "cpu-ui",
                    "--limit", "1", log="worker-cpu.log")
        yield fleet, on_demand
    finally:
        fleet.stop()


def _base(fleet: Fleet) -> str:
    return fleet.api_url.removesuffix("/api")


# --- reading the page --------------------------------------------------------------------------

# Every property of the form: its labels from the top down, what it renders, whose it is.
READ_FORM = r"""
function label(el) {
  const l = el.querySelector(':scope > .p-label__header .schema-form-property__label');
  return l ? l.innerText.trim() : null;
}
function own(el, selector) {
  return [...el.querySelectorAll(selector)].filter(x => x.closest('.schema-form-property') === el);
}
return [...document.querySelectorAll('.schema-form-property')].map(el => {
  const chain = [];
  for (let p = el; p; p = p.parentElement) {
    if (p.classList && p.classList.contains('schema-form-property')) chain.unshift(label(p));
  }
  const description = el.querySelector(':scope > .p-label__header .schema-form-property__description');
  const choices = [...el.querySelectorAll(':scope > .p-label__body > .p-button-group > button')];
  return {
    chain,
    description: description ? description.innerText : '',
    json: own(el, '.schema-form-property-kind-json').length > 0,
    selects: own(el, 'select:not(.p-native-select__control--placeholder)').map(s => [...s.options].map(o => o.value)),
    choices: choices.map(b => b.innerText.trim()),
    chosen: choices.filter(b => b.getAttribute('aria-selected') === 'true').map(b => b.innerText.trim()),
  };
});
"""

FIND_PROPERTY = r"""
const chain = arguments[0];
function label(el) {
  const l = el.querySelector(':scope > .p-label__header .schema-form-property__label');
  return l ? l.innerText.trim().replace(/ \(Optional\)$/, '') : null;
}
return [...document.querySelectorAll('.schema-form-property')].filter(el => {
  const labels = [];
  for (let p = el; p; p = p.parentElement) {
    if (p.classList && p.classList.contains('schema-form-property')) labels.unshift(label(p));
  }
  return JSON.stringify(labels) === JSON.stringify(chain);
});
"""

# The element that scrolls the page (Prefect's layout scrolls a container, not the document).
SCROLLED_HEIGHT = r"""
let extra = 0;
for (const el of document.querySelectorAll('*')) {
  const overflow = getComputedStyle(el).overflowY;
  if (overflow === 'auto' || overflow === 'scroll') extra = Math.max(extra, el.scrollHeight - el.clientHeight);
}
return window.innerHeight + extra;
"""


def _wait(driver, condition, what: str, timeout: float = 60):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: condition(d))
    except TimeoutException:
        raise AssertionError(f"{what}: not within {timeout} s on {driver.current_url}") from None


def _open(driver, url: str, ready: str, what: str, timeout: float = 90) -> None:
    from selenium.webdriver.common.by import By

    driver.set_window_size(WIDTH, 1000)
    driver.get(url)
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ready), what, timeout)


def _full_page(driver, path: Path) -> Path:
    """The whole page: the window made as tall as what its container scrolls."""
    height = driver.execute_script(SCROLLED_HEIGHT)
    driver.set_window_size(WIDTH, min(int(height) + 200, 16000))
    time.sleep(1)  # layout and fonts after the resize
    driver.save_screenshot(str(path))
    return path


@contextlib.contextmanager
def _screenshot_on_failure(driver, path: Path):
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            _full_page(driver, path)
        raise


def _property(driver, *chain: str):
    hits = driver.execute_script(FIND_PROPERTY, ["spec", *chain])
    assert len(hits) == 1, f"{' > '.join(chain)}: {len(hits)} properties in the form"
    return hits[0]


def _click(driver, element) -> None:
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    element.click()


def _submit(driver) -> None:
    """Submit the form; again (twice at most) only where the server answered its create_flow_run with 503
    (1 submit in 4 here). Prefect's SQLite server answers a write that meets another's lock (SQLITE_BUSY:
    the worker's polls write too) with 503, for the client to retry: its Python client does, its UI shows
    "Something went wrong" and keeps the form filled, and a user submits again. Any other answer fails."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    busy: list[str] = []

    def answered(d) -> bool:
        if not d.current_url.split("?")[0].endswith("/run"):
            return True
        busy.extend(e["message"] for e in d.get_log("browser")
                    if "create_flow_run" in e["message"] and " 503 " in e["message"])
        return bool(busy)

    def click(d, attempt: int) -> bool:  # the page redraws as its toasts come and go: find the button anew
        try:
            [submit] = [b for b in d.find_elements(By.CSS_SELECTOR, "button") if b.text.strip() == "Submit"]
            if attempt == 1:
                _click(d, submit)
            else:  # the error's toast lies over the button
                d.execute_script("arguments[0].click()", submit)
        except (StaleElementReferenceException, ValueError):
            return False
        return True

    for attempt in (1, 2, 3):
        _wait(driver, lambda d: click(d, attempt), "the Submit button clicked", timeout=30)
        _wait(driver, answered, "the form submitted")
        if not driver.current_url.split("?")[0].endswith("/run"):
            return
        assert attempt < 3, f"the server answered 503 three times: {busy}"
        print(f"the server was busy, submitting again: {busy}")
        busy.clear()
        time.sleep(2)


def _options(driver, chain: tuple[str, ...]):
    from selenium.webdriver.common.by import By

    return _property(driver, *chain).find_elements(By.CSS_SELECTOR, ":scope > .p-label__body > .p-button-group > button")


def _choose(driver, chain: tuple[str, ...], option: str) -> None:
    """Click a union's option button (Prefect's anyOf picker)."""
    from selenium.common.exceptions import StaleElementReferenceException

    buttons = _options(driver, chain)
    [button] = [b for b in buttons if b.text.strip() == option] or [None]
    assert button is not None, f"{' > '.join(chain)} offers {[b.text for b in buttons]}, not {option!r}"
    _click(driver, button)

    def chosen(d) -> bool:  # the form draws the property again
        try:
            return any(b.text.strip() == option and b.get_attribute("aria-selected") == "true"
                       for b in _options(d, chain))
        except StaleElementReferenceException:
            return False

    _wait(driver, chosen, f"{' > '.join(chain)}: {option}", 10)


ADD_ITEM = "+ item"  # to_open's option for a list of sections: add one, as a person would, to see its fields


def _add_item(driver, chain: tuple[str, ...]) -> None:
    """Add one item to a list of sections (the gate's candidates) so its fields are drawn."""
    from selenium.webdriver.common.by import By

    def items(d) -> int:
        return len(d.execute_script(READ_FORM))

    before = items(driver)
    buttons = _property(driver, *chain).find_elements(By.CSS_SELECTOR, "button")
    adds = [b for b in buttons if "add" in b.text.strip().lower()]
    assert adds, f"{' > '.join(chain)} offers {[b.text for b in buttons]}, none of them adds an item"
    _click(driver, adds[0])
    _wait(driver, lambda d: items(d) > before, f"{' > '.join(chain)}: an item's fields", 10)


def _open_section(driver, chain: tuple[str, ...], option: str) -> None:
    if option == ADD_ITEM:
        _add_item(driver, chain)
    else:
        _choose(driver, chain, option)


def _type(driver, chain: tuple[str, ...], value: str) -> None:
    from selenium.webdriver.common.by import By

    field = _property(driver, *chain).find_element(By.CSS_SELECTOR, ":scope > .p-label__body textarea, "
                                                                    ":scope > .p-label__body input")
    _click(driver, field)
    field.clear()
    field.send_keys(value)


def _select(driver, chain: tuple[str, ...], value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    select = _property(driver, *chain).find_element(
        By.CSS_SELECTOR, ":scope > .p-label__body select:not(.p-native-select__control--placeholder)")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", select)
    Select(select).select_by_value(value)


# --- what the schema says the form must show ---------------------------------------------------

def _text(markdown: str) -> str:
    """A description as the form's markdown renders it, compared without formatting."""
    return " ".join(markdown.replace("`", "").replace("->", "→").split())


def _expected(schema: dict) -> tuple[dict[tuple, dict], list[tuple[tuple, str]]]:
    """Every property the form must show, by its labels from the top; and the union options that
    open a section (the gate, the index, a response format, the gate's candidate), or add an item
    to a list of sections (the gate's candidates), in the order to click them."""
    definitions = schema["definitions"]
    expected: dict[tuple, dict] = {}
    to_open: list[tuple[tuple, str]] = []

    def definition(ref: str) -> dict:
        return definitions[ref.rsplit("/", 1)[1]]

    def walk(properties: dict, required: list[str], chain: tuple) -> None:
        for key, prop in properties.items():
            title = prop.get("title")
            assert title, f"{' > '.join(chain)} > {key} has no title: the form shows {key!r} title-cased"
            label = title if key in required else f"{title} (Optional)"
            here = (*chain, label)
            kind: object = None
            if "$ref" in prop:
                section = definition(prop["$ref"])
                kind = "section"
                walk(section["properties"], section.get("required", []), here)
            elif "anyOf" in prop:
                options = []
                for option in prop["anyOf"]:
                    if "$ref" in option:
                        section = definition(option["$ref"])
                        options.append(section["title"])
                        to_open.append((here, section["title"]))
                        walk(section["properties"], section.get("required", []), here)
                    else:
                        options.append(option.get("title"))
                kind = ("union", options)
            elif "enum" in prop:
                kind = ("enum", [str(v) for v in prop["enum"]])
            elif prop.get("type") == "object" and "properties" not in prop:
                kind = FREE_FORM
            elif prop.get("type") == "array" and "$ref" in prop.get("items", {}):
                item = definition(prop["items"]["$ref"])
                if not prop.get("default"):  # an empty list: its item's fields show once one is added
                    to_open.append((here, ADD_ITEM))
                walk(item["properties"], item.get("required", []), here)
            expected[here] = {"description": _text(prop.get("description", "")), "kind": kind}

    job = definitions["PrefectJob"]
    walk(job["properties"], job["required"], ("spec",))
    # messages shows its default, one message; its items' fields come from the anyOf's array option
    messages = definitions["GenerationParams"]["properties"]["messages"]
    [array] = [o for o in messages["anyOf"] if o.get("type") == "array"]
    item = definition(array["items"]["$ref"])
    walk(item["properties"], item.get("required", []), ("spec", "Generation (Optional)", "Messages (Optional)"))
    return expected, to_open


# --- the tests ---------------------------------------------------------------------------------

def test_the_run_form_shows_every_jobspec_section_titled_with_its_described_fields(ui, browser, screenshots):
    fleet, on_demand = ui
    expected, to_open = _expected(on_demand.parameter_openapi_schema)
    with _screenshot_on_failure(browser, screenshots / "form-structure-failure.png"):
        _open(browser, f"{_base(fleet)}/deployments/deployment/{on_demand.id}/run", ".schema-form-property",
              "the on-demand deployment's run form")
        _wait(browser, lambda d: len(d.execute_script(READ_FORM)) >= 60, "the JobSpec form's fields")
        for chain, option in to_open:  # the optional sections, opened as a person would
            _open_section(browser, tuple(label.removesuffix(" (Optional)") for label in chain[1:]), option)
        rendered = browser.execute_script(READ_FORM)
        _full_page(browser, screenshots / "form-every-section.png")

    shown = {tuple(p["chain"]): p for p in rendered}
    assert len(shown) == len(rendered), "two properties of the form show the same labels"
    missing = sorted(set(expected) - set(shown))
    extra = sorted(set(shown) - set(expected) - {("spec",)})
    assert not missing and not extra, f"the form lacks {missing} and shows {extra}"
    for chain, want in expected.items():
        got, where = shown[chain], " > ".join(chain)
        assert want["description"] and _text(got["description"]) == want["description"], \
            f"{where}: the form says {got['description']!r}, the schema {want['description']!r}"
        kind = want["kind"]
        assert got["json"] == (kind == FREE_FORM), f"{where}: a raw JSON box" if got["json"] else \
            f"{where}: no JSON editor for a free-form mapping"
        if isinstance(kind, tuple) and kind[0] == "enum":
            assert got["selects"] == [kind[1]], f"{where}: offers {got['selects']}, not the choices {kind[1]}"
        if isinstance(kind, tuple) and kind[0] == "union":
            assert len(got["choices"]) == len(kind[1]), f"{where}: choices {got['choices']} for {kind[1]}"
            for title, button in zip(kind[1], got["choices"]):
                assert title is None or button == title, f"{where}: choice {button!r} for {title!r}"

    # the model and generation choices, offered as choices
    model = ("spec", "Model (Optional)")
    assert shown[(*model, "Engine (Optional)")]["selects"] == [["auto", "vllm", "transformers", "onnxruntime", "openvino", "openai-server"]]
    assert shown[(*model, "Dtype (Optional)")]["selects"] == [list(DTYPES)]
    assert shown[(*model, "Name (Optional)")]["choices"] == ["Path or Hugging Face name", "Built-in model"]
    assert shown[(*model, "Quantization (Optional)")]["choices"] == ["Common method", "Other vLLM method", "None"]
    assert shown[("spec", "Mode (Optional)")]["selects"] == [["embed", "generate"]]
    generation = ("spec", "Generation (Optional)")
    assert shown[(*generation, "Messages (Optional)", "Role (Optional)")]["selects"] == [["system", "user",
                                                                                         "assistant"]]
    assert shown[(*generation, "Response format (Optional)")]["chosen"] == ["Response format"]
    # the gate's candidate and reference are models with the same choices
    gate = ("spec", "Eval gate (Optional)")
    assert shown[(*gate, "Reference model", "Engine (Optional)")]["selects"] == [["auto", "vllm", "transformers", "onnxruntime", "openvino"]]
    assert shown[(*gate, "Candidate model (Optional)", "Dtype (Optional)")]["selects"] == [list(DTYPES)]

    # a union's enum option renders as a select once chosen: the quantization methods, the built-in models
    _choose(browser, ("Model", "Quantization"), "Common method")
    _choose(browser, ("Model", "Name"), "Built-in model")
    rendered = {tuple(p["chain"]): p for p in browser.execute_script(READ_FORM)}
    assert rendered[(*model, "Quantization (Optional)")]["selects"] == [list(QUANTIZATIONS)]
    assert rendered[(*model, "Name (Optional)")]["selects"] == [["all-MiniLM-L6-v2", "SmolLM2-135M-Instruct"]]


def test_a_run_submitted_from_the_form_completes_and_its_page_shows_the_artifacts(ui, browser, screenshots,
                                                                                  tmp_path):
    from selenium.webdriver.common.by import By

    fleet, on_demand = ui
    random.seed(33)
    ids = [f"doc-{i:03d}" for i in range(ROWS)]
    texts = [" ".join(random.choice(WORDS) for _ in range(random.randint(5, 60))) for _ in ids]
    write_parquet(tmp_path / "corpus.parquet", ids, texts, row_group_size=SHARD_ROWS)
    out = tmp_path / "out"
    tracking_uri = f"sqlite:///{tmp_path}/mlflow.db"

    with _screenshot_on_failure(browser, screenshots / "form-failure.png"):
        _open(browser, f"{_base(fleet)}/deployments/deployment/{on_demand.id}/run", ".schema-form-property",
              "the on-demand deployment's run form")
        _wait(browser, lambda d: len(d.execute_script(READ_FORM)) >= 60, "the JobSpec form's fields")
        _type(browser, ("Input",), str(tmp_path / "corpus.parquet"))
        _type(browser, ("Output",), str(out))
        _choose(browser, ("Model", "Name"), "Built-in model")
        _select(browser, ("Model", "Name"), "all-MiniLM-L6-v2")
        _select(browser, ("Model", "Engine"), "transformers")  # no vLLM start: a small corpus, 2 cores
        _type(browser, ("Batching", "Max Shard Rows"), str(SHARD_ROWS))
        _choose(browser, ("Passthrough Columns",), "All columns")
        _select(browser, ("Passthrough Columns",), "all")
        _type(browser, ("Tracking (MLflow)", "MLflow Tracking URI"), tracking_uri)
        run_name = browser.find_element(By.CSS_SELECTOR, ".flow-run-name-input input").get_attribute("value")
        assert run_name, "the form proposes no run name"
        _form_screenshot(browser, screenshots)
        _submit(browser)

    with fleet.client() as client:
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[on_demand.id])))
        [run] = [r for r in runs if r.name == run_name]
        final = _wait_for(client, run.id, 360, fleet)
        assert final.state.is_completed(), f"{final.state}\n{fleet.logs()}"
    spec = run.parameters["spec"]  # what the form sent
    assert (spec["input"], spec["output"], spec["model"]["name"], spec["model"]["engine"]) == \
        (str(tmp_path / "corpus.parquet"), str(out), "all-MiniLM-L6-v2", "transformers")
    assert spec["batching"]["max_shard_rows"] == SHARD_ROWS and spec["passthrough_columns"] == "all"
    assert spec["tracking"]["mlflow_tracking_uri"] == tracking_uri
    assert spec["generation"]["messages"] == [m.model_dump() for m in GenerationParams().messages]
    written = pq.read_table(out, columns=["id", "text"])
    assert sorted(written.column("id").to_pylist()) == ids  # passthrough: all brought the text along

    base = _base(fleet)
    with _screenshot_on_failure(browser, screenshots / "run-failure.png"):
        _open(browser, f"{base}/runs/flow-run/{run.id}", "li.p-tab#logs", "the run page")
        _wait(browser, lambda d: "4 shards from" in d.find_element(By.TAG_NAME, "body").text
              and "rows: 40 in = 40 out + 0 rejected" in d.find_element(By.TAG_NAME, "body").text,
              "the run's logs, with the shards and the summary")
        _click(browser, browser.find_element(By.CSS_SELECTOR, "li.p-tab#artifacts"))
        browser.set_window_size(WIDTH, 2000)  # the cards are in a virtual scroller: drawn once in view
        cards = _wait(browser, lambda d: (lambda found: found if len(found) >= 3 else None)(_artifact_cards(d)),
                      "the run's three artifacts")
        assert {key: kind for key, (kind, _) in cards.items()} == {
            "tokenmill-progress": "PROGRESS", "tokenmill-shards": "TABLE", "tokenmill-summary": "MARKDOWN"}
        browser.set_window_size(WIDTH, 1000)  # the screenshot as tall as the page, no taller
        time.sleep(2)  # the run graph draws on a canvas
        _full_page(browser, screenshots / "run.png")

        summary = _artifact_page(browser, base, cards["tokenmill-summary"][1], "h1", screenshots / "run-summary.png")
        heading = summary.find_element(By.CSS_SELECTOR, "h1").text
        items = [li.text for li in summary.find_elements(By.CSS_SELECTOR, "li")]
        assert heading == "tokenmill embed run", heading
        assert f"rows: {ROWS} in = {ROWS} out + 0 rejected (0 truncated)" in items, items
        assert any(item.startswith("cost: ") and "per 1M tokens" in item for item in items), items

        table = _artifact_page(browser, base, cards["tokenmill-shards"][1], "tbody tr", screenshots / "run-shards.png")
        headers = [th.text for th in table.find_elements(By.CSS_SELECTOR, "thead th")]
        body = [[td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")]
                for tr in table.find_elements(By.CSS_SELECTOR, "tbody tr")]
        assert headers[:6] == ["shard", "rows in", "rows out", "rejected", "truncated", "tokens"], headers
        assert headers[6:] == ["tokens/s", "seconds", "padding", "cached"], headers
        assert len(body) == ROWS // SHARD_ROWS, body
        assert all(row[1] == row[2] == str(SHARD_ROWS) for row in body), body
        assert all(re.fullmatch(r"\d+\.\d%", row[headers.index("padding")]) for row in body), body

        progress = _artifact_page(browser, base, cards["tokenmill-progress"][1], ".artifact-data-progress",
                                  screenshots / "run-progress.png")
        assert "Progress: 100%" in progress.text, progress.text


def _form_screenshot(driver, screenshots: Path) -> None:
    """The filled-in form, whole (form-filled.png), and its first sections, down to the end of the
    model's, for the README (form.png)."""
    from PIL import Image
    from selenium.webdriver.common.by import By

    whole = _full_page(driver, screenshots / "form-filled.png")
    generation = _property(driver, "Generation")
    bottom = generation.location["y"] + 8 - driver.find_element(By.CSS_SELECTOR, "body").location["y"]
    with Image.open(whole) as image:
        image.crop((0, 0, image.width, min(image.height, int(bottom)))).save(screenshots / "form.png")
    driver.set_window_size(WIDTH, 1000)


def _artifact_cards(driver) -> dict[str, tuple[str, str]]:
    """The run page's artifact cards: key -> (type, link)."""
    links = driver.execute_script("""return [...document.querySelectorAll(
        ".flow-run-artifacts a[href*='/artifacts/artifact/']")].map(a => [a.innerText, a.href]);""")
    cards = {}
    for text, href in links:  # read in one go: the list is drawn again as artifacts arrive
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) >= 2:
            cards[lines[1]] = (lines[0], href)
    return cards


def _artifact_page(driver, base: str, href: str, content: str, screenshot: Path):
    """An artifact's own page, once `content` (a selector) shows in its data view."""
    from selenium.webdriver.common.by import By

    assert href.startswith(base), href
    _open(driver, href, f".artifact-data-view {content}", f"the artifact page {href}")
    time.sleep(1)
    _full_page(driver, screenshot)
    driver.set_window_size(WIDTH, 1000)
    return driver.find_element(By.CSS_SELECTOR, ".artifact-data-view")
