"""Accessibility in Chromium against the real server: an axe-core audit (axe-playwright-python)
of the walkthrough with every widget ready, of every embed and of /benchmark; the keyboard
keeps focus on the control it used; the page in the dark scheme passes axe's contrast rule;
screenshots in both schemes for a person to look at.

The site's content security policy forbids the injected axe script, so these pages run in a
browser context with bypass_csp (the policy itself is tested in test_app and test_security).
Each audit's violations are written to the artifacts folder as JSON.
"""

import json

import pytest
from axe_playwright_python.sync_playwright import Axe

from app.widgets import BY_NAME
from conftest import wait_ready

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

BUILT = sorted(BY_NAME)
SLOW_WIDGETS = {"quantization": 600_000, "kv-eviction": 600_000}   # as test_browser: first jobs take minutes
BLOCKING = {"serious", "critical"}
AXE = Axe()
STEP = '[data-widget="generation"] button.gen-step'


@pytest.fixture
def page_for(tabs, server):
    """page_for(viewport=, color_scheme=) -> a recorded Page (conftest.Page) of the session's kept
    tab whose context bypasses the CSP (axe is injected as a script); a second call goes on in
    the same tab, as the first page's test is done with it."""
    pages = []

    def make(**options):
        if pages:
            pages[-1].detach()
        pages.append(tabs.page(server, bypass_csp=True, **options))
        return pages[-1]
    yield make
    if pages:
        pages[-1].detach()


def audit(page, name: str, artifacts_dir, options=None) -> list[str]:
    """Run axe on the page; write its violations to artifacts; return the serious and critical
    ones as "rule (impact): n nodes, e.g. <target>" lines."""
    found = AXE.run(page, options=options or {"resultTypes": ["violations"]}).response["violations"]
    (artifacts_dir / f"axe-{name}.json").write_text(json.dumps(
        [{"id": v["id"], "impact": v["impact"], "help": v["help"],
          "nodes": [{"target": n["target"], "summary": n.get("failureSummary", "")} for n in v["nodes"]]}
         for v in found], indent=1))
    return [f"{v['id']} ({v['impact']}): {len(v['nodes'])} nodes, e.g. {v['nodes'][0]['target']}"
            for v in found if v["impact"] in BLOCKING]


def all_ready(pg) -> None:
    page = pg.page
    pg.goto("/")
    for name in BUILT:   # widgets mount when scrolled near: bring each into view
        page.locator(f'[data-widget="{name}"]').scroll_into_view_if_needed()
        wait_ready(page, f'[data-widget="{name}"]', SLOW_WIDGETS.get(name, 120_000))
    page.evaluate("() => window.scrollTo(0, 0)")


def test_walkthrough_with_every_widget_ready(page_for, artifacts_dir):
    pg = page_for()
    all_ready(pg)
    assert audit(pg.page, "index", artifacts_dir) == []
    pg.assert_clean()


@pytest.mark.parametrize("name", BUILT)
def test_embed(page_for, artifacts_dir, name):
    pg = page_for()
    assert pg.goto(f"/embed/{name}").status == 200
    wait_ready(pg.page, f'[data-widget="{name}"]', SLOW_WIDGETS.get(name, 120_000))
    assert audit(pg.page, f"embed-{name}", artifacts_dir) == []
    pg.assert_clean()


def test_benchmark_page(page_for, artifacts_dir):
    pg = page_for()
    assert pg.goto("/benchmark").status == 200
    pg.page.wait_for_selector("main.bench:not([data-state='loading'])")
    assert audit(pg.page, "benchmark", artifacts_dir) == []
    pg.assert_clean()


def test_dark_scheme_contrast(page_for, artifacts_dir):
    pg = page_for(color_scheme="dark")
    all_ready(pg)
    assert audit(pg.page, "index-dark-contrast", artifacts_dir, {"runOnly": ["color-contrast"]}) == []


def test_skip_link_is_first_and_jumps_to_the_content(page_for):
    pg = page_for()
    pg.goto("/")
    page = pg.page
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.className") == "skip-link"
    page.keyboard.press("Enter")
    page.wait_for_function("() => location.hash === '#content'")


def focused(page) -> str:
    return page.evaluate("""() => { const e = document.activeElement;
        return e === document.body || !e ? 'BODY' : e.tagName + '.' + e.className + ':' + e.textContent.trim(); }""")


def test_the_keyboard_reaches_decode_and_focus_stays_on_it(page_for):
    pg = page_for()
    pg.goto("/embed/generation")
    page = pg.page
    wait_ready(page, '[data-widget="generation"]', 120_000)
    for _ in range(60):          # Tab from the top until the step button has focus
        page.keyboard.press("Tab")
        if page.evaluate(f"() => document.activeElement === document.querySelector('{STEP}')"):
            break
    else:
        pytest.fail(f"Tab never reached the step button; focus is on {focused(page)}")
    for want in ("Decode next token", "Decode next token"):   # a prefill, then a decode step
        page.keyboard.press("Enter")
        page.wait_for_function(f"""() => {{ const b = document.querySelector('{STEP}');
            return !b.disabled && b.textContent === '{want}'; }}""", timeout=120_000)
        wait_ready(page, '[data-widget="generation"]', 120_000)
        assert page.evaluate(f"() => document.activeElement === document.querySelector('{STEP}')"), \
            f"after an action focus fell to {focused(page)}"
    pg.assert_clean()


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_screenshots_in_both_schemes(page_for, artifacts_dir, scheme):
    """For a person to look at: / and two embeds at 1280x800 and 390 px wide."""
    for width, height in ((1280, 800), (390, 844)):
        pg = page_for(color_scheme=scheme, viewport={"width": width, "height": height})
        page = pg.page
        pg.goto("/")
        page.locator('[data-widget="chat"]').scroll_into_view_if_needed()
        wait_ready(page, '[data-widget="chat"]', 120_000)
        page.evaluate("() => window.scrollTo(0, 0)")
        page.screenshot(path=str(artifacts_dir / f"a11y-index-{scheme}-{width}.png"))
        for name in ("generation", "attention"):
            pg.goto(f"/embed/{name}")
            wait_ready(page, f'[data-widget="{name}"]', 120_000)
            page.screenshot(path=str(artifacts_dir / f"a11y-{name}-{scheme}-{width}.png"), full_page=True)
        pg.assert_clean()
