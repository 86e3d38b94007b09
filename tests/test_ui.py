"""The ``/ui`` page in a real browser: Debian's headless Chromium through its chromedriver
(``make test`` installs both), driven by Selenium against a real daemon with an API key.

Screenshots of each step land in the test's own tmp directory.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from served import ServedDaemon, served_with_key

from branchbox import Sandbox

KEY = "ui-test-key"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM = "/usr/bin/chromium"
WAIT = 30


@pytest.fixture(scope="module")
def daemon() -> Iterator[ServedDaemon]:
    with served_with_key("ui", KEY) as served:
        yield served


@pytest.fixture
def browser(tmp_path: Path):
    try:
        from selenium import webdriver
    except ImportError:
        pytest.fail("selenium is missing: pip install -e '.[test]' (make test does)")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            pytest.fail(f"{path} is missing: apt-get install chromium chromium-driver "
                        "(make test does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(lambda d: condition(d))
    except TimeoutException:
        pytest.fail(f"the page never showed {what}:\n{driver.page_source[:4000]}")


def _node(driver, sandbox_id: str):
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f'li.node[data-id="{sandbox_id}"]')
    return found[0] if found else None


def _family_nodes(driver, family: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(
        By.CSS_SELECTOR, f'section.family[data-family="{family}"] li.node')


def test_the_page_refuses_without_the_key(daemon: ServedDaemon, browser) -> None:
    from selenium.webdriver.common.by import By

    assert httpx.get(f"{daemon.url}/ui").status_code == 401
    assert httpx.get(f"{daemon.url}/ui", params={"key": "wrong"}).status_code == 401
    assert httpx.get(f"{daemon.url}/ui", cookies={"branchbox_key": "wrong"}).status_code == 401
    browser.get(f"{daemon.url}/ui")
    assert "needs one of the server's API keys" in browser.page_source
    assert not browser.find_elements(By.ID, "families")
    # The form on the refusal takes the key once, then the page opens.
    browser.find_element(By.NAME, "key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "form button").click()
    _wait(browser, lambda d: d.find_elements(By.ID, "families"), "the tree after the form")


def test_the_cookie_opens_only_what_the_page_uses(daemon: ServedDaemon) -> None:
    """The page's cookie is no API key: not for the rest of the API (the port proxy above
    all, whose pages would share the daemon's origin), and not for a write without the
    page's own header (a cross-site form cannot send one)."""
    page = httpx.Client(base_url=daemon.url, cookies={"branchbox_key": KEY}, timeout=60)
    with page, Sandbox(url=daemon.url, api_key=KEY) as sb, sb.fork(1)[0] as child:
        with page.stream("GET", "/v1/events") as events:
            assert events.status_code == 200
        assert page.get("/ui/stats").json()["sandboxes"][sb.id][0] == "ready"
        diff = f"/v1/sandboxes/{sb.id}/diff"
        assert page.post(diff, json={"other": child.id}).status_code == 401
        ui = {"X-Branchbox-UI": "1"}
        assert page.post(diff, json={"other": child.id}, headers=ui).status_code == 200
        for method, path in (("GET", "/v1/sandboxes"), ("GET", f"/v1/sandboxes/{sb.id}"),
                             ("GET", f"/v1/sandboxes/{sb.id}/ports/8000/"),
                             ("POST", f"/v1/sandboxes/{sb.id}/fork")):
            reply = page.request(method, path, headers=ui, json={})
            assert reply.status_code == 401, (method, path, reply.text)


def test_a_fork_merge_round_shows_live(daemon: ServedDaemon, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{daemon.url}/ui?key={KEY}")
    assert browser.current_url == f"{daemon.url}/ui"  # the key left the address bar
    (cookie,) = browser.get_cookies()
    assert cookie["name"] == "branchbox_key" and cookie["httpOnly"] is True
    assert browser.execute_script("return document.cookie") == ""
    _wait(browser, lambda d: d.find_element(By.ID, "status").text == "live", "a live stream")
    browser.execute_script("window.notReloaded = true")

    with Sandbox(url=daemon.url, api_key=KEY) as parent:
        parent.run_code("print('hello from the parent')")
        children = parent.fork(n=3)
        _wait(browser, lambda d: len(_family_nodes(d, parent.id)) == 4, "4 nodes of the family")
        for child in children:
            assert _node(browser, child.id).get_attribute("data-parent") == parent.id
        browser.save_screenshot(str(tmp_path / "1-forked.png"))

        children[0].run_code("open('/root/won.txt', 'w').write('the winner')")
        parent.merge_into(children[0])
        _wait(browser, lambda d: "retired" in _node(d, children[0].id).get_attribute("class"),
              "the winner retired by the merge")
        parent_card = _node(browser, parent.id).find_element(By.CSS_SELECTOR, ".card")
        assert f"merged ← {children[0].id[:12]}" in parent_card.text
        winner_card = _node(browser, children[0].id).find_element(By.CSS_SELECTOR, ".card")
        assert "won" in winner_card.text and "merged" in winner_card.text
        browser.save_screenshot(str(tmp_path / "2-merged.png"))
        (again,) = parent.fork(1)  # a second merge into the same parent: one badge, counted
        parent.merge_into(again)
        _wait(browser, lambda d: "(2 merges)" in _node(d, parent.id).text, "a second merge")
        assert len(_node(browser, parent.id).find_elements(By.CSS_SELECTOR,
                                                           ":scope > .card .merged")) == 1

        children[2].close()
        _wait(browser, lambda d: "closed" in _node(d, children[2].id).text, "a closed branch")

        # Two nodes selected: the parent (now with the winner's file) and a sibling.
        parent_card.click()
        _wait(browser, lambda d: "hello from the parent" in d.find_element(By.ID, "details").text,
              "the parent's last run and its output")
        # The second by keyboard: a card takes the focus and Enter selects it.
        _node(browser, children[1].id).find_element(By.CSS_SELECTOR, ".card").send_keys(
            Keys.ENTER)
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#diff .diff-removed"),
              "the diff of two nodes")
        removed = browser.find_element(By.CSS_SELECTOR, "#diff .diff-removed")
        assert "/root/won.txt" in removed.text
        browser.save_screenshot(str(tmp_path / "3-diff.png"))
        assert browser.execute_script("return window.notReloaded") is True

        # A page opened now shows the same tree: the merged winner and the closed branch
        # greyed where they were, and the parent's runs.
        browser.refresh()
        _wait(browser, lambda d: d.find_element(By.ID, "status").text == "live",
              "the reloaded page")
        assert len(_family_nodes(browser, parent.id)) == 5
        for gone, state in ((children[0], "merged"), (again, "merged"), (children[2], "closed")):
            node = _node(browser, gone.id)
            assert "retired" in node.get_attribute("class") and state in node.text
            assert node.get_attribute("data-parent") == parent.id
        _node(browser, parent.id).find_element(By.CSS_SELECTOR, ".card").click()
        assert "hello from the parent" in browser.find_element(By.ID, "details").text
        children[1].close()
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
    assert all((tmp_path / name).stat().st_size > 0
               for name in ("1-forked.png", "2-merged.png", "3-diff.png"))


def test_the_page_keeps_a_bounded_number_of_greyed_nodes(daemon: ServedDaemon, browser) -> None:
    """A page left open while agents fork and close thousands of sandboxes keeps the
    newest 2,000 greyed nodes (and any with children under them), not all: events in the
    stream's own shape, fed to the page's script as its EventSource would."""
    browser.get(f"{daemon.url}/ui?key={KEY}")
    browser.execute_script("""
        for (let i = 0; i < 2100; i++) {
          const id = "sbx_" + String(i).padStart(32, "0");
          enqueue({id: 2 * i + 1, type: "create", ts: Date.now() / 1000, sandbox: id,
                   parent: null, family: id});
          enqueue({id: 2 * i + 2, type: "close", ts: Date.now() / 1000, sandbox: id,
                   parent: null, family: id});
        }""")
    count = "return document.querySelectorAll('section.family li.node.retired').length"
    _wait(browser, lambda d: d.execute_script(count) == 2000, "2,000 greyed nodes")
    oldest = "return document.querySelector('li.node.retired').dataset.id"
    assert browser.execute_script(oldest) == "sbx_" + "100".zfill(32)
    assert browser.execute_script("return document.querySelectorAll('section.family').length") \
        == 2000

