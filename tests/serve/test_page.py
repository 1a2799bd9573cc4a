"""The page at / in a real browser: Debian's headless chromium, driven by Playwright, against a live server on the
bundled fashion-mnist model (and fashion-mnist-t2i: the prompt flow). Generate shows one image per seed with its
parameters (and prompt, and the prompt's warnings); a bad field shows the 422."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdiff.serve.app import create_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def test_page_generates_images_with_their_parameters(browser, serve_app):
    app = create_app("fashion-mnist", device="cpu", steps=3, max_batch=4, max_wait_ms=100, queue_size=16)
    with serve_app(app) as url:
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_selector("#generate:enabled")
        assert page.locator("#prompt-row").is_hidden() and page.locator("#guidance-row").is_hidden()
        assert page.locator("#prompt").is_disabled()
        assert page.input_value("#steps") == "3" and page.input_value("#sampler") == "ddim"
        assert "fashion-mnist" in page.inner_text("#model-name")
        samplers = page.locator("#sampler option").all_inner_texts()
        assert samplers == list(app.state.model_info.samplers)

        page.fill("#seed", "41")
        page.fill("#steps", "2")
        page.select_option("#sampler", "dpmsolver++")
        page.fill("#n", "3")
        page.click("#generate")
        page.wait_for_function("document.querySelectorAll('figure.result').length === 3", timeout=120_000)
        page.wait_for_selector("#generate:enabled")
        figures = page.locator("figure.result")
        seeds = sorted(int(figures.nth(k).get_attribute("data-seed")) for k in range(3))
        assert seeds == [41, 42, 43]
        for k in range(3):
            figure = figures.nth(k)
            assert figure.get_attribute("data-steps") == "2" and figure.get_attribute("data-sampler") == "dpmsolver++"
            caption = figure.locator("figcaption").inner_text()
            assert f"seed {figure.get_attribute('data-seed')}" in caption and "2 steps" in caption
            assert "dpmsolver++" in caption and " ms" in caption
            width = figure.locator("img").evaluate("img => img.complete ? img.naturalWidth : 0")
            assert width == 32, "the PNG did not decode"
        assert page.inner_text("#status").startswith("3 of 3 images in")
        assert page.inner_text("#error") == ""

        page.fill("#steps", "0")
        page.fill("#n", "1")
        page.click("#generate")
        page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=20_000)
        assert "steps: Input should be greater than or equal to 1" in page.inner_text("#error")
        assert page.locator("figure.result").count() == 0
        page.close()


def test_page_prompt_flow_on_the_bundled_text_model(browser, serve_app, t2i_app):
    """fashion-mnist-t2i: the text fields show (guidance at the server's default, the init image for img2img); a
    prompt gives one image per seed captioned with its prompt, and the prompt's warnings are listed."""
    with serve_app(t2i_app) as url:
        page = browser.new_page()
        page.goto(url + "/")
        page.wait_for_selector("#generate:enabled")
        assert page.locator("#prompt").is_visible() and page.locator("#negative_prompt").is_visible()
        assert page.input_value("#guidance") == "3" and page.input_value("#steps") == "2"
        assert page.input_value("#guided_from") == "0"
        assert page.locator("#init_image-row").is_visible()

        page.fill("#prompt", "ankle boot zzyzx")
        page.fill("#negative_prompt", "sandal")
        page.fill("#guidance", "4")
        page.fill("#guided_from", "0.5")
        page.fill("#seed", "7")
        page.fill("#n", "2")
        page.click("#generate")
        page.wait_for_function("document.querySelectorAll('figure.result').length === 2", timeout=120_000)
        page.wait_for_selector("#generate:enabled")
        figures = page.locator("figure.result")
        assert sorted(int(figures.nth(k).get_attribute("data-seed")) for k in range(2)) == [7, 8]
        for k in range(2):
            figure = figures.nth(k)
            assert figure.get_attribute("data-prompt") == "ankle boot zzyzx"
            assert figure.locator("figcaption .prompt").inner_text() == "ankle boot zzyzx"
            caption = figure.locator("figcaption").inner_text()
            assert "not: sandal" in caption and "guidance 4 from 0.5 of the steps" in caption and "2 steps" in caption
            assert figure.locator("img").evaluate("img => img.complete ? img.naturalWidth : 0") == 32
        warnings = page.locator("#warnings li").all_inner_texts()
        assert len(warnings) == 1 and "zzyzx" in warnings[0]  # the same warning of both requests, listed once
        assert page.inner_text("#error") == ""

        page.fill("#prompt", "")
        page.fill("#n", "1")
        page.click("#generate")
        page.wait_for_function("document.getElementById('error').textContent.length > 0", timeout=20_000)
        assert "'prompt' (or 'prompts') is required" in page.inner_text("#error")
        assert page.locator("figure.result").count() == 0 and page.locator("#warnings li").count() == 0
        page.close()
