// Drives the explorer page in headless Chromium (Debian's, through playwright-core: no
// browser download) for compat_tests/test_explorer.py. Prints one JSON line of what the
// page showed; the Python test asserts on it.
//   node browser_test.mjs URL TOPIC OFFSET [SCREENSHOT.png]
// Env: HK_CHROMIUM, the chromium executable; HK_PIN_KEY, the node key to pin (else the page's).
import { chromium } from 'playwright-core'

const [url, topic, offset, screenshot] = process.argv.slice(2)
const browser = await chromium.launch({
  executablePath: process.env.HK_CHROMIUM,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage']
})
const out = { errors: [] }
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 600 } })
  page.on('pageerror', (err) => out.errors.push(String(err)))

  async function check (name, key = '') {
    await page.fill('#v-topic', topic)
    await page.fill('#v-partition', '0')
    await page.fill('#v-offset', offset)
    await page.fill('#v-key', key)
    await page.evaluate(() => { document.getElementById('verdict').className = '' })
    await page.click('#v-go')
    await page.waitForSelector('#verdict.ok, #verdict.failed', { timeout: 10000 })
    out[name] = {
      verdict: await page.textContent('#verdict'),
      ok: await page.$eval('#verdict', (e) => e.className === 'ok'),
      records: await page.$$eval('#records tr', (rows) => rows.map((r) => [...r.cells].map((c) => c.textContent)))
    }
  }

  await page.goto(url)
  await page.waitForFunction((t) => document.getElementById('topics').textContent.includes(t), topic, { timeout: 10000 })
  out.topics = await page.$$eval('#topics tr', (rows) => rows.map((r) => [...r.cells].map((c) => c.title || c.textContent)))
  out.nodeKey = await page.textContent('#node-key')
  out.groups = await page.$$eval('#groups tr', (rows) => rows.map((r) => [...r.cells].map((c) => c.textContent)))

  await check('honest')
  // HK_PIN_KEY: the writer's node key, when the page is a mirror's (whose own key must fail)
  const nodeKey = process.env.HK_PIN_KEY || out.nodeKey
  await check('pinned', nodeKey)
  if (process.env.HK_PIN_KEY) await check('pageNodeKey', out.nodeKey)
  if (screenshot) await page.screenshot({ path: screenshot, fullPage: true })
  await check('wrongKey', 'ab'.repeat(32))

  // The node lies about the catalog: one byte of its first block changed.
  await page.route('**/v1/catalog?**', async (route) => {
    const response = await route.fetch()
    const doc = await response.json()
    const block = Buffer.from(doc.blocks[0], 'base64')
    block[block.length - 1] ^= 0x01
    doc.blocks[0] = block.toString('base64')
    await route.fulfill({ response, json: doc })
  })
  await check('tamperedCatalog', nodeKey)
  await page.unroute('**/v1/catalog?**')

  // The node lies: the same proof with one byte of the batch changed.
  await page.route('**/proof?**', async (route) => {
    const response = await route.fetch()
    const doc = await response.json()
    const batch = Buffer.from(doc.batch, 'base64')
    batch[batch.length - 1] ^= 0x01
    doc.batch = batch.toString('base64')
    await route.fulfill({ response, json: doc })
  })
  await check('tamperedBatch', nodeKey)
  await page.unroute('**/proof?**')
  // ... or one byte of a proof node's hash.
  await page.route('**/proof?**', async (route) => {
    const response = await route.fetch()
    const doc = await response.json()
    const nodes = [...doc.block_nodes, ...doc.upgrade_nodes, ...doc.additional_nodes]
    out.proofNodes = nodes.length
    if (nodes.length) nodes[0].hash = (nodes[0].hash[0] === '0' ? '1' : '0') + nodes[0].hash.slice(1)
    else doc.signature = (doc.signature[0] === '0' ? '1' : '0') + doc.signature.slice(1)
    await route.fulfill({ response, json: doc })
  })
  await check('tamperedNode', nodeKey)
} catch (err) {
  out.errors.push(String(err && err.stack ? err.stack : err))
} finally {
  await browser.close()
}
console.log(JSON.stringify(out))
