"""The playground page of `kog serve` in a real headless browser (Debian's chromium + chromium-driver,
driven by selenium): type a question, see the answer stream in and a tokens/s figure appear. The page
loads nothing from outside the server (no CDN)."""
from __future__ import annotations

import re
import shutil

import pytest

from serve_helpers import Coordinator, Serve, tiny_model

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="chromium and chromium-driver are not installed "
                                       "(apt-get install -y chromium chromium-driver)")


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--disable-extensions", "--window-size=1200,800"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    drv.set_page_load_timeout(30)
    yield drv
    drv.quit()


def test_playground_streams_an_answer_with_tokens_per_s(tmp_path, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    model = tiny_model(tmp_path / "m")
    # tokens every 30 ms, so the answer visibly streams in
    with Coordinator(model, delay=0.03) as c, Serve("--connect", c.endpoint, "--served-model-name", "tiny") as s:
        browser.get(s.url + "/")
        wait = WebDriverWait(browser, 20, poll_frequency=0.05)
        wait.until(lambda d: "tiny" in d.find_element(By.ID, "model").text)
        for field, value in (("max_tokens", "60"), ("temperature", "0"), ("seed", "1")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        box = browser.find_element(By.ID, "input")
        box.send_keys("What is a river?")
        box.send_keys(Keys.ENTER)
        # streaming: part of the answer is on the page while the send button still reads Stop
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
                   and d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
                   and d.find_element(By.ID, "send").text == "Stop")
        wait.until(lambda d: d.find_element(By.ID, "send").text == "Send")
        user = browser.find_elements(By.CSS_SELECTOR, ".msg.user")
        assert [u.text for u in user] == ["What is a river?"]
        stats = browser.find_element(By.ID, "stats").text
        assert re.search(r"TTFT \d+ ms", stats) and re.search(r"[\d.]+ tokens/s", stats), stats
        n = int(re.search(r"(\d+) tokens$", stats).group(1))
        assert 1 < n <= 60, stats                  # the usage count of the answer (it may end at EOS)
        answer = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text
        assert answer and "[" not in answer[-1:]
        # the page asked nothing of any other origin
        entries = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
        assert all(e.startswith(s.url) for e in entries), entries
