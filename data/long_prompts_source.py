"""Source of ``data/long_prompts.jsonl``: the long-prompt / short-answer prompt set (issue 27), written for
kvlab. OverFill pays off for long prompts and short answers, so every prompt here is a 300-800 token
context — a document, a multi-turn history or a few-shot prompt — ending in a question that two or
three sentences answer (32-64 tokens). Run ``python data/long_prompts_source.py`` to rewrite the
JSON Lines file; ``tests/test_long_prompts.py`` checks the committed file is what this writes, the
lengths, and that no prompt overlaps the training prompts.
"""
from __future__ import annotations

import json
from pathlib import Path

ANSWER = "Answer in two or three sentences."

# --------------------------------------------------------------------------- documents + one question each
DOCUMENTS = [
    ("memo", """MEMORANDUM — Harlow Creek Town Council, Public Works Committee

Subject: Proposed changes to the winter road maintenance schedule

Over the past three winters the town has spent an average of 41 percent of its road budget on snow and ice control, up from 28 percent five years ago. The increase has three causes. First, the number of freeze-thaw cycles recorded at the municipal weather station has nearly doubled, which means crews salt the same roads several times a week instead of once after each storm. Second, the price of road salt delivered to our depot rose from 62 to 97 dollars per ton after the regional supplier closed its northern warehouse. Third, two of our five plow trucks are more than eighteen years old and spent a combined 73 days in the repair shop last season.

The committee proposes the following changes for the coming winter. Roads will be divided into three priority tiers: tier one covers the hospital access road, the two school routes and Main Street; tier two covers collector roads; tier three covers residential cul-de-sacs. Tier one roads will be treated with brine before forecast storms, which uses about a third as much salt as treating after snowfall. Tier three roads will be plowed only once accumulation passes eight centimetres, rather than five. The town will lease one new plow truck for three years instead of buying it outright, keeping the older trucks as reserves.

The committee estimates that these steps will reduce salt use by about 30 percent and bring total winter spending back to roughly 33 percent of the road budget. Residents of tier three streets may see plows arrive up to six hours later than in previous years. A public meeting on the proposal will be held in the library hall on the second Tuesday of October.""",
     "Why does the committee expect salt use to fall, and what is the main cost to residents of residential cul-de-sacs?"),
    ("manual", """Aqualine K4 Countertop Water Filter — Owner's Guide, Section 3: Cartridge Care

The K4 uses a two-stage cartridge. The outer stage is a pleated polypropylene sleeve that traps sediment, rust flakes and sand down to five microns. The inner stage is a block of compressed activated carbon that adsorbs chlorine, many pesticides and compounds that cause unpleasant taste and odour. The carbon block does not remove dissolved minerals such as calcium or magnesium, so the filter will not soften hard water or prevent scale in kettles.

Cartridge life depends on both volume and time. The cartridge is rated for 3,000 litres, which for a household of four is typically five to six months. However, the carbon block should be replaced after eight months even if the volume has not been reached, because bacteria can colonise damp carbon over long periods. The indicator light on the base counts litres, not months, so owners who use little water should mark the installation date on the cartridge label.

Before first use, run water through a new cartridge for three minutes and discard it. This flushes out loose carbon fines, which are harmless but make the first litres look grey. If the flow rate drops below about half a litre per minute before the cartridge is due, the sediment sleeve is probably clogged. In homes with well water or old iron pipes this can happen within weeks. The sleeve can be rinsed under a tap once, but a second clog means the cartridge must be replaced.

Never run hot water through the K4. Water above 38 degrees Celsius can release adsorbed chemicals back into the stream and may warp the housing seal. If the filter has not been used for more than two weeks, for example after a holiday, flush it for five minutes before drinking the water.""",
     "A family uses very little water and the indicator light has not come on after nine months. What should they do and why?"),
    ("museum", """Gallery 7: The Salt Roads of the Western Desert

This gallery traces the caravan routes that carried rock salt from the dry lakes of the interior to the river towns between roughly the tenth and sixteenth centuries. Salt was cut from the lake beds in slabs weighing about thirty kilograms, each marked with the symbol of the family that held the cutting rights. Two of these slabs are displayed in the central case; the carved marks on the upper slab belong to the Tenzar family, whose rights are recorded in a land grant shown on the wall to your left.

A caravan typically included between two hundred and eight hundred camels and travelled at night during the hottest months. Guides navigated by the stars and by a chain of wells spaced about four days apart. Losing a well to a sandstorm or a collapse could end a season's trade, so towns along the route paid well-keepers in salt to clear and line the shafts with stone. The copper lamp in case 7C was found at the bottom of such a well and still contains traces of the animal fat it burned.

In the river towns salt was exchanged for grain, cloth, dried fish and gold dust. Merchants' ledgers show that a single slab could buy enough millet to feed a family for two months. Because the value of salt was stable and it could be divided, it served in some markets as a form of money; small cut bars were used to pay soldiers and boatmen.

The trade declined in the sixteenth century, when sea routes along the coast made imported salt cheaper in the river towns and the interior kingdoms lost control of several key wells during a long drought. The final case shows a carved wooden tally stick from the last recorded caravan, which reached the river in 1583 with only ninety camels.""",
     "According to the exhibit, why did the desert salt trade decline?"),
    ("policy", """Northfield Community Laboratory — Safety Policy for Shared Equipment (summary for new members)

1. Booking. All members must book the laser cutter, the 3D printers and the pottery kiln through the online calendar. Bookings are limited to two hours per member per day on the laser cutter and four hours on the printers. A booking that is not claimed within fifteen minutes of its start time is released to the waiting list.

2. Induction. Nobody may use the laser cutter or the kiln without completing the matching induction session, which is run every Saturday morning by a volunteer supervisor. Inductions expire after twelve months; members whose induction has expired keep their booking rights but must attend a short refresher before their next session. The 3D printers need no induction, but a printed guide is kept beside each machine.

3. Materials. Only materials on the approved list may be cut with the laser. PVC and vinyl are strictly forbidden because cutting them releases chlorine gas, which damages the lenses and is dangerous to breathe. Members who are unsure about a material must ask a supervisor before cutting and should bring the product data sheet if they have it.

4. Supervision. The kiln may only be fired when a supervisor is in the building, because firings run for up to ten hours and the kiln room reaches high temperatures. Members may load their work at any time but must leave a firing ticket on the kiln door.

5. Incidents. Any fire, injury or machine fault must be reported in the incident book on the same day, even if nobody was hurt. Repeated breaches of this policy can lead to a suspension of booking rights for up to three months, decided by the members' committee.

6. Cleaning. Members must clear scrap from the laser bed, remove failed prints and sweep the pottery area before they leave. Cleaning time counts as part of the booking.""",
     "A member's laser cutter induction expired last month. Can they still book the cutter, and what must they do before using it?"),
    ("story", """The ferry to Skellan Island ran twice a week in winter, and Maren had missed the Tuesday boat by eleven minutes. She stood on the pier with her grandmother's suitcase, watching the wake fold back into grey water, and calculated that the next crossing on Friday would leave her three days short of the date on the letter from the solicitor.

The harbourmaster, a broad man named Teodor who wore his cap pushed back, listened to her explanation without interrupting. When she had finished he said that the post boat went out on Wednesday mornings, and that the skipper, his cousin Alvar, sometimes carried a passenger if the passenger did not mind sitting among the sacks and did not complain about the smell of diesel. It would cost her nothing, Teodor said, except that she would have to help unload at the island.

Maren spent the night in the only guesthouse in the harbour town, where the landlady served fish soup and asked no questions. At six the next morning she found the post boat, a squat blue vessel with a tarpaulin roof, already half loaded. Alvar turned out to be much younger than his cousin and far more talkative. During the crossing he told her that her grandmother had been the island's schoolteacher for thirty years, that she had taught him to read, and that she had kept a ledger of every child who had ever borrowed a book from her and not returned it.

When they reached the island, Maren carried sacks of letters and parcels up the slipway for nearly an hour. At the top, a small crowd had gathered, and an old woman stepped forward holding a cloth-bound ledger. "Your grandmother asked me to give you this," she said, "and to tell you that every name in it has been forgiven.\"""",
     "How did Maren reach the island in time, and what did she have to do in return?"),
    ("company", """Brightwater Bicycles: A Short History

Brightwater began in 1962 as a repair shop run by two brothers, Osric and Hal Penrose, in a rented garage behind a bakery. For its first decade the business earned most of its money fixing delivery bicycles used by local shops. In 1971 the brothers built their first frame, a heavy steel touring bike with mounts for racks on both wheels, after customers complained that imported touring frames cracked on the region's cobbled roads.

The touring frame sold steadily but slowly until 1978, when a national newspaper followed two students who rode Brightwater bicycles from the northern coast to the southern border without a single broken spoke. Orders tripled within a year. The company moved to a former textile mill, hired forty workers and began making frames in batches instead of one at a time.

The 1990s were difficult. Cheap aluminium bicycles from large overseas factories undercut Brightwater's prices, and the company lost money in six of ten years. Rather than move production abroad, Hal's daughter Imogen, who became managing director in 1994, cut the range from fourteen models to four and introduced a lifetime frame warranty. She also opened a repair school in the old mill, whose fees covered the cost of keeping skilled welders on the payroll during slow months.

Since 2005 the company has grown again, mainly by selling directly to customers online and by making frames for cargo bicycles used by couriers in cities. Brightwater now employs about 160 people. It still builds every frame in the same mill, and the original garage is preserved as a small museum where visitors can see the brothers' first workbench.""",
     "What did Imogen Penrose change when the company was struggling, and how did the repair school help?"),
    ("recipe", """Slow Oat and Barley Porridge for Busy Mornings

Most porridge recipes assume you have twenty minutes to stand at the stove. This one moves the work to the night before. Whole barley grains and steel-cut oats take a long time to soften, but they do most of that softening while soaking, so a short simmer in the morning is enough.

In the evening, rinse 60 grams of pearl barley under cold water until the water runs clear; this removes loose starch that would otherwise make the porridge gluey. Put the barley in a saucepan with 60 grams of steel-cut oats, a pinch of salt and 600 millilitres of water. Bring it to the boil, let it bubble for exactly one minute, then turn off the heat, put the lid on and leave the pan on the hob overnight. The brief boil kills surface bacteria and starts the grains absorbing water; the closed lid keeps the heat in for the first hour.

In the morning, add 200 millilitres of milk, or a plant milk if you prefer, and bring the pan back to a gentle simmer. Stir often for eight to ten minutes, until the barley is tender but still slightly chewy and the liquid has thickened. If it gets too thick, add a splash more milk; it will thicken further as it cools in the bowl.

Serve with grated apple and a spoonful of yoghurt, or with toasted seeds and a little honey. The porridge keeps in the fridge for three days and reheats well with extra liquid, so you can cook a double batch on Sunday. Pearl barley contains gluten, so people with coeliac disease should replace it with an equal weight of whole buckwheat, which needs the same treatment.""",
     "Why does the recipe boil the grains for one minute the night before instead of cooking them fully in the morning?"),
    ("travel", """Visitor Notes: Isla Corrente

Isla Corrente lies about forty kilometres off the mainland and is reached by a ferry that takes two and a half hours in calm weather. The island is small — you can walk from the harbour at Porto Baixo to the lighthouse at its northern tip in about three hours — and there are no car rentals. Most visitors hire bicycles or use the single bus, which runs every ninety minutes in summer and three times a day in winter.

The island's main attraction is its coastline. The western shore faces the open ocean and has steep cliffs, strong currents and no lifeguards; swimming there is dangerous and signs at the clifftop paths say so in four languages. The eastern shore is sheltered and has three sandy coves with calm water, the largest of which, Praia do Moinho, has a lifeguard from June to September.

Fresh water is scarce. The island depends on a desalination plant and rainwater tanks, and in dry summers hotels may ask guests to limit showers. Visitors are asked to carry refillable bottles; the tap water is safe to drink and there are refill fountains at the harbour, the market and the lighthouse car park.

The island's food is built around fish, goat cheese and a dense maize bread baked in wood ovens. The Friday market in Porto Baixo is the best place to try them. Restaurants close early by mainland standards, usually by nine in the evening, and many close entirely on Mondays. Cash is still widely used: the island has one cash machine, at the harbour, and it sometimes runs empty on summer weekends, so bring enough money with you.""",
     "A family with young children wants to swim and buy food at the market on a summer weekend. What two pieces of advice from the notes matter most for them?"),
    ("release", """Ledgerly 4.2 — Release Notes

Ledgerly 4.2 is a maintenance release for the desktop bookkeeping application. It focuses on import reliability and on a change to how recurring transactions are stored.

Bank import. Files exported by several banks in the newer CSV format, which puts the currency code in its own column, were previously rejected with the message "unexpected column count". Version 4.2 detects this layout automatically. Files with dates written as day-month-year are now recognised when the day is greater than twelve; when every date in a file is ambiguous, Ledgerly asks the user which order to use instead of guessing.

Recurring transactions. In earlier versions each recurring transaction stored a copy of its schedule, so editing the amount of a monthly rent payment changed only future copies created after the edit, and past months could disagree with each other. In 4.2 schedules are stored once and every occurrence refers to them. When a user edits a recurring amount, Ledgerly now asks whether the change applies from a chosen date onwards; earlier occurrences keep their old amount. On first start, 4.2 converts existing schedules. This conversion cannot be undone, so the installer makes a backup of the company file in the same folder, named with the date and the suffix ".pre42".

Reports. The profit and loss report now lists uncategorised transactions in their own line instead of silently leaving them out. Some users will therefore see totals that differ from the same report in 4.1; the difference is the sum of uncategorised items.

Known issue. Printing a report with more than 2,000 lines may stall on some printers. Exporting the report to PDF and printing the PDF avoids the problem. A fix is planned for 4.2.1.""",
     "Why might a user's profit and loss totals differ after upgrading to 4.2, and what should they check?"),
    ("onboarding", """Welcome to the Night Desk — Orientation Notes for New Dispatchers at Carrow Valley Emergency Services

Your first four weeks are a supervised period. During this time you will take calls only with a mentor listening on a second headset, and every call you handle will be reviewed with you at the end of the shift. You will not dispatch units on your own until your mentor and the shift lead have both signed your competency sheet.

Calls are answered in the order they arrive, with one exception: the screen flags calls from numbers that have called three or more times in the past hour, and those are answered first, because repeated calls often mean a situation is getting worse. When two calls arrive at the same moment, take the one that has waited longer according to the queue timer, not the one at the top of the list.

Every call follows the same structure: location first, then the nature of the emergency, then the caller's callback number. Location comes first because a call can drop at any moment, and with a location we can still send help. Do not rely on the automatic location shown for mobile phones; it can be wrong by several hundred metres, especially in the valley where signals bounce off the hillsides. Always ask the caller to confirm a street name, a landmark or a kilometre marker.

Breaks are taken in rotation so that at least three dispatchers are always at their desks. If the queue has more than five waiting calls, breaks are postponed until it clears. Take your break anyway if you have handled a distressing call and feel you need it; tell the shift lead, who will cover your desk. Talking about difficult calls is normal here, and the service offers free, confidential counselling to all staff.""",
     "Why are dispatchers told to ask for the location first and not to trust the automatic location?"),
    ("abstract", """Study summary: Effects of classroom window orientation on afternoon test performance

Background. Several small studies have suggested that daylight in classrooms is linked to better attention, but few have separated the effect of light from the effect of heat, because sunny classrooms are often also warmer.

Methods. We followed 1,140 students aged 12 to 14 in 48 classrooms across nine schools over one school year. Classrooms were grouped by the direction their main windows faced. Every classroom had a sensor recording light level and air temperature every five minutes. Students took the same short attention and arithmetic test twice a week, once in the morning and once in the afternoon, in their usual classroom. We compared afternoon scores across window orientations while adjusting for morning scores, school, age and classroom temperature.

Results. Students in west-facing classrooms scored on average 4 percent lower on afternoon tests than students in north-facing classrooms. However, once classroom temperature was included in the model, the difference fell to 1 percent and was no longer statistically significant. West-facing rooms were on average 2.8 degrees warmer in the afternoon. Classrooms with working blinds that teachers actually used showed no afternoon drop at all, regardless of orientation. Morning scores did not differ between orientations.

Conclusions. The lower afternoon performance in west-facing classrooms appears to be explained mainly by heat rather than by light. Simple measures such as blinds, ventilation and moving tests to the morning may remove most of the gap. The study was observational, so we cannot rule out other differences between classrooms, and it did not measure students' sleep or meals.""",
     "What explained the lower afternoon scores in west-facing classrooms, and what evidence supports that?"),
    ("minutes", """Minutes — Allotment Association, Annual General Meeting

Present: 31 members. Chair: R. Okafor. Secretary: L. Brandt.

1. Water. The treasurer reported that the water bill rose by 38 percent this year. Most of the increase came from a leak in the underground pipe near plots 40 to 46, which was found in August and repaired by the water company at no charge for the repair itself. Members agreed to install a meter on each of the four standpipes so that future leaks are noticed within weeks. Cost: about 600 pounds, to be paid from reserves.

2. Rent. The committee proposed raising the annual plot rent from 45 to 52 pounds, the first increase in five years, to rebuild the reserves after the meter installation. After discussion, members voted to raise it to 50 pounds and to review the rent again next year. Members over seventy and members receiving income support keep their half-price rent.

3. Waiting list. There are 27 people on the waiting list, the longest list in the association's history. Six plots were not cultivated this year. Under the rules, a tenant whose plot is uncultivated for a full season receives a written warning and can lose the plot after a further three months. The committee will inspect in April. Members also agreed to allow large plots to be split in half when a tenant asks, so that new members can start with a smaller area.

4. Shared shed. The roof of the shared tool shed leaks. A member offered to repair it with materials costing about 120 pounds if two volunteers help for one weekend. Three members volunteered.

5. Any other business. A member asked whether bonfires could be allowed again in winter. The chair reminded the meeting that the council banned them after complaints from neighbouring houses, and the ban remains.""",
     "What did the meeting decide about the plot rent, and why was an increase needed?"),
]

# --------------------------------------------------------------------------- question/answer pool (few-shot and multi-turn)
TOPICS = {
    "beekeeping": [
        ("How often should a beginner open a hive during the summer?",
         "About once every seven to ten days is enough. Each inspection should check for eggs, signs of a healthy queen and "
         "whether the colony is running out of space. Opening the hive more often stresses the bees and cools the brood."),
        ("Why do bees build queen cells along the bottom of the frames?",
         "Cells hanging from the lower edge are usually swarm cells. The colony is preparing to split, with the old queen leaving "
         "with part of the workers. Beekeepers respond by giving the colony more space or by making an artificial swarm."),
        ("What is the purpose of a smoker?",
         "Smoke masks the alarm scent that guard bees release and makes many bees eat honey, which calms them. A few gentle puffs "
         "at the entrance and under the lid are enough; too much smoke drives bees off the frames and makes inspection harder."),
        ("How much honey should be left for the bees in autumn?",
         "In a cool climate a colony usually needs fifteen to twenty kilograms of stores to survive the winter. If the hive "
         "feels light when lifted from the back, the beekeeper can feed thick sugar syrup until the middle of autumn."),
        ("Why are varroa mites such a problem?",
         "The mites feed on developing bees and spread viruses, including one that deforms wings. Without treatment a colony's "
         "mite population grows each season until the colony collapses, often in late autumn or winter."),
    ],
    "sourdough": [
        ("Why does a new sourdough starter smell strongly of acetone after a few days?",
         "The yeast and bacteria are hungry and producing by-products as the food runs out. Feeding the starter more often, or "
         "with a larger share of fresh flour, usually makes the smell fade within a week as the culture stabilises."),
        ("How can I tell when my dough has finished its bulk fermentation?",
         "The dough should have grown by roughly half, feel airy and jiggle when the bowl is shaken, with bubbles visible on the "
         "sides and the surface. Time alone is a poor guide, because temperature changes the speed a great deal."),
        ("Why do bakers fold the dough instead of kneading it?",
         "Folds build gluten strength gradually while the dough rests between sets, so less work is needed and the dough keeps "
         "more gas. Three or four sets of folds during the first two hours are common for a wet dough."),
        ("What does an overnight rest in the fridge do?",
         "Cold slows the yeast more than the bacteria, so the flavour becomes more sour and complex while the dough hardly rises. "
         "A cold dough is also firmer, which makes it easier to score cleanly before baking."),
        ("Why is the bread baked with a lid for the first part of the bake?",
         "The lid traps steam from the dough, which keeps the crust soft long enough for the loaf to expand fully. Removing the "
         "lid after about twenty minutes lets the crust dry out, brown and become crisp."),
    ],
    "bicycle repair": [
        ("Why does my chain keep slipping when I pedal hard?",
         "The most common cause is a worn chain on a worn cassette: the stretched chain no longer sits properly in the teeth. "
         "A chain checker shows the wear; replacing the chain early, before the cassette wears, saves money."),
        ("How tight should bicycle tyres be?",
         "It depends on the tyre width and the rider's weight. Narrow road tyres often run at six to eight bar, wide touring "
         "tyres at three to five. The recommended range is printed on the tyre's sidewall."),
        ("Why do my rim brakes squeal?",
         "Squealing usually comes from dirty rims or pads, or from pads that hit the rim flat instead of touching it first at "
         "the front edge. Cleaning both surfaces and adjusting the pads with a slight toe-in normally stops the noise."),
        ("What causes a wheel to wobble from side to side?",
         "Uneven spoke tension pulls the rim toward one side. Small wobbles can be fixed with a spoke key by tightening spokes "
         "on the opposite side a quarter turn at a time; a large wobble after a crash may mean the rim is bent."),
        ("How often should I oil the chain?",
         "Oil it when it looks dry or starts to make noise, and always after riding in the rain. Apply one drop per link, turn "
         "the pedals for a minute and wipe off the excess, because oil on the outside only attracts grit."),
    ],
    "composting": [
        ("Why does my compost heap smell bad?",
         "A foul smell usually means the heap is too wet and has run out of air. Mixing in dry brown material such as shredded "
         "cardboard or leaves and turning the heap lets oxygen back in and the smell fades within days."),
        ("What should not go into a home compost bin?",
         "Meat, fish, dairy and cooked food attract rats and smell as they rot, so most home bins leave them out. Diseased plants "
         "and the roots of persistent weeds can also survive a cool heap and spread back into the garden."),
        ("How long does it take to make compost?",
         "A well-mixed heap that is turned every few weeks can be ready in three to four months in summer. A heap that is left "
         "alone still works, but it may take a year or more, especially through a cold winter."),
        ("Why is my compost not getting warm?",
         "The heap may be too small, too dry or short of green material such as grass clippings. A heap of about one cubic "
         "metre with a good mix of greens and browns, moist like a wrung-out sponge, heats up much better."),
        ("Is it a problem to see worms and woodlice in the bin?",
         "No, they are a good sign. Worms and woodlice break down the material and their presence shows the compost is moist and "
         "well aerated. They move away on their own once the compost is finished."),
    ],
    "chess": [
        ("Why do chess coaches tell beginners to control the centre?",
         "Pieces in the centre reach more squares and can move quickly to either side of the board. Controlling the central "
         "squares with pawns and pieces also restricts the opponent's pieces and makes their plans harder."),
        ("When should I castle?",
         "Usually early, within the first ten or so moves, once the pieces between king and rook have moved. Castling tucks the "
         "king behind pawns and connects the rooks; leaving the king in the centre invites attacks along open files."),
        ("Why is it bad to move the same piece several times in the opening?",
         "Each move spent on one piece is a move not spent developing another. The opponent gets ahead in development and can "
         "often attack before all of your pieces have joined the game."),
        ("What is a fork?",
         "A fork is a move where one piece attacks two or more enemy pieces at the same time. Since the opponent can usually save "
         "only one of them, forks often win material; knights are especially good at them."),
        ("How should I use my rooks?",
         "Rooks are strongest on open files, where no pawns block them, and on the seventh rank, where they attack the opponent's "
         "pawns. Doubling the rooks on one file makes them stronger still."),
    ],
    "budgeting": [
        ("What is the first step in making a personal budget?",
         "Track what you actually spend for a month, including small purchases. Most people underestimate spending on food and "
         "subscriptions, and a real record shows where the money goes before you decide where it should go."),
        ("Why keep an emergency fund?",
         "An emergency fund pays for sudden costs such as a car repair or a lost job without borrowing. Many advisers suggest "
         "three to six months of essential expenses, built up gradually in an easy-access savings account."),
        ("Should I pay off debt or save first?",
         "Many people keep a small emergency buffer first, then pay off the most expensive debt, such as credit cards, as fast as "
         "possible. The interest on such debt is usually far higher than anything savings can earn."),
        ("What is the fifty-thirty-twenty rule?",
         "It is a simple budgeting guide: about half of take-home pay for needs such as rent and bills, thirty percent for "
         "wants and twenty percent for saving or paying down debt. The split is a starting point, not a strict law."),
        ("How can I stop overspending on groceries?",
         "Plan meals for the week, shop with a list and avoid shopping when hungry. Buying store brands and cooking larger "
         "batches that last several days also lowers the cost of each meal."),
    ],
    "houseplants": [
        ("Why are the leaves of my houseplant turning yellow?",
         "The most common cause is overwatering, which starves the roots of air. Check whether the soil is still wet a few "
         "centimetres down before watering again, and make sure the pot has drainage holes."),
        ("How do I know when a plant needs repotting?",
         "Roots growing out of the drainage holes or circling the surface of the soil are the usual signs. Water running "
         "straight through the pot without soaking in also shows the plant has filled its container."),
        ("Why does my plant lean toward the window?",
         "Plants grow toward their light source. Turning the pot a quarter turn every week or two keeps the growth even on "
         "all sides."),
        ("Do houseplants need fertiliser in winter?",
         "Most do not. Growth slows in the shorter, darker days, so the plant uses little food, and unused fertiliser can build "
         "up as salts in the soil. Feeding can resume in spring when new growth appears."),
        ("What causes brown, crispy leaf tips?",
         "Dry air, irregular watering or salt build-up from fertiliser are common causes. Watering thoroughly so that water runs "
         "out of the pot, and grouping plants to raise humidity, often helps."),
    ],
    "running": [
        ("How fast should most of my training runs be?",
         "Most runs should be at an easy pace, slow enough that you can speak in full sentences. Easy running builds endurance "
         "with little risk of injury, and it lets you recover for the few harder sessions each week."),
        ("How much should I increase my weekly distance?",
         "A common guideline is to add no more than about ten percent per week, and to take an easier week every third or "
         "fourth week. Bones and tendons adapt more slowly than the heart and lungs."),
        ("Why do my shins hurt after running?",
         "Shin pain in new runners is often caused by increasing distance too quickly, running on hard surfaces or worn shoes. "
         "Rest and a slower build-up usually help; pain that is sharp at one spot should be checked for a stress fracture."),
        ("What should I eat before a long run?",
         "A light meal rich in carbohydrates two to three hours before, such as toast with honey or a bowl of porridge, gives "
         "energy without upsetting the stomach. Foods high in fat or fibre are better avoided just before running."),
        ("Is stretching before a run necessary?",
         "Long static stretches before running have not been shown to prevent injury. A short warm-up of brisk walking, easy "
         "jogging and leg swings prepares the muscles better."),
    ],
}

# few-shot prompts: an instruction, the examples of several topics, then one new question
FEWSHOT_QUESTIONS = [
    ("beekeeping", "Why do some beekeepers paint their hives in different colours?"),
    ("sourdough", "Why does my sourdough loaf spread flat instead of rising upwards in the oven?"),
    ("bicycle repair", "Why does my gear shifting feel slow and imprecise after a muddy ride?"),
    ("composting", "Can I put citrus peel and onion skins into a worm bin?"),
    ("chess", "Why is it usually a bad idea to bring the queen out early?"),
    ("budgeting", "How should I budget when my income changes from month to month?"),
    ("houseplants", "Why do the leaves of my cactus look pale and stretched?"),
    ("running", "How can I tell whether I am running too many hard sessions?"),
    ("beekeeping", "What should a beekeeper do if a colony has no queen and no eggs?"),
    ("sourdough", "Why is the crumb of my bread dense and gummy in the middle?"),
    ("chess", "What does it mean to have a bad bishop?"),
    ("houseplants", "Is tap water safe for houseplants, or should I use rainwater?"),
    ("running", "Should I run on the day after a long race?"),
    ("composting", "Why are there small flies around my kitchen compost caddy?"),
]

# multi-turn histories: one topic's pool as the conversation so far, then a follow-up that needs it
FOLLOWUPS = [
    ("beekeeping", "Thanks. Given everything you said, what are the two checks I should never skip at an inspection?"),
    ("sourdough", "So if my kitchen is cold, which of the steps you described will take longer, and what can I do about it?"),
    ("bicycle repair", "Of the problems we talked about, which one can I prevent with a few minutes of care each week?"),
    ("composting", "My heap is small, wet and smells. Based on your answers, what should I change first?"),
    ("chess", "Can you sum up the opening advice you gave me as a short checklist for my next game?"),
    ("budgeting", "I have credit card debt and no savings. Following your advice, what should I do this month?"),
    ("houseplants", "My plant has yellow leaves and brown tips at the same time. Which of your explanations fits best?"),
    ("running", "I am training for my first ten kilometre race. Which two pieces of your advice matter most?"),
    ("beekeeping", "It is early autumn and the hive feels light. What should I do, going by our conversation?"),
    ("sourdough", "Which steps you mentioned most affect how sour the bread tastes?"),
    ("chess", "Which of the ideas you explained should I practise first if I keep losing material early?"),
    ("budgeting", "My grocery bill is the biggest surprise in my tracking. Which of your suggestions should I start with?"),
    ("running", "My shins hurt after I added a lot of distance last week. What should I change, going by your advice?"),
    ("houseplants", "It is winter and my plant looks unhappy near a sunny window. What should I do and not do?"),
]

FEWSHOT_HEAD = ("You are a helpful assistant who answers practical questions briefly and accurately. Here are examples of "
                "the style of answer wanted.\n\n")


def fewshot_prompt(i: int, topic: str, question: str) -> str:
    names = list(TOPICS)
    # six examples from other topics (rotating with i) and one from the question's own topic
    others = [t for t in names if t != topic]
    picks = [(others[(i + k) % len(others)], (i + k) % 5) for k in range(5)] + [(topic, i % 5)]
    shots = "\n\n".join(f"Q: {TOPICS[t][j][0]}\nA: {TOPICS[t][j][1]}" for t, j in picks)
    return f"{FEWSHOT_HEAD}{shots}\n\nNow answer this question in the same style. {ANSWER}\nQ: {question}\nA:"


def multiturn_prompt(i: int, topic: str, followup: str) -> str:
    pairs = TOPICS[topic]
    order = pairs[i % 2:] + pairs[:i % 2]              # a different opening turn when a topic is used twice
    turns = "\n\n".join(f"User: {q}\nAssistant: {a}" for q, a in order)
    return ("Below is a conversation between a user and an assistant about " + topic + ". Continue it by writing the "
            f"assistant's next reply. {ANSWER}\n\n{turns}\n\nUser: {followup}\nAssistant:")


def long_prompts() -> list[dict]:
    rows = []
    for i, (kind, doc, q) in enumerate(DOCUMENTS):
        rows.append({"id": f"long-doc-{i:02d}", "kind": "document", "topic": kind,
                     "prompt": f"Read the following text and answer the question after it.\n\n{doc}\n\nQuestion: {q} {ANSWER}",
                     "question": q})
    for i, (topic, q) in enumerate(FEWSHOT_QUESTIONS):
        rows.append({"id": f"long-fewshot-{i:02d}", "kind": "few-shot", "topic": topic,
                     "prompt": fewshot_prompt(i, topic, q), "question": q})
    for i, (topic, q) in enumerate(FOLLOWUPS):
        rows.append({"id": f"long-multiturn-{i:02d}", "kind": "multi-turn", "topic": topic,
                     "prompt": multiturn_prompt(i, topic, q), "question": q})
    # interleave the three kinds so that the first n prompts of the file mix them
    by_kind = [[r for r in rows if r["kind"] == k] for k in ("document", "few-shot", "multi-turn")]
    out = []
    for k in range(max(len(b) for b in by_kind)):
        out += [b[k] for b in by_kind if k < len(b)]
    return out


def render() -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in long_prompts())


if __name__ == "__main__":
    path = Path(__file__).with_name("long_prompts.jsonl")
    path.write_text(render(), encoding="utf-8")
    print(f"wrote {len(long_prompts())} prompts to {path}")
