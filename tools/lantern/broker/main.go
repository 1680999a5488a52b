// broker: the getlantern/pubsub broker (pubsub.NewBroker, unchanged) on a plain TCP
// listener. The repository's own broker/main.go serves TLS with certificates from
// Let's Encrypt (autocert), which a loopback benchmark cannot get; the broker code it
// runs is the same. Built by tools/bench_gateway.py --vs-lantern.
package main

import (
	"flag"
	"fmt"
	"net"
	"os"

	"github.com/getlantern/pubsub"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "TCP address to listen on")
	authkey := flag.String("authkey", "", "key publishers authenticate with")
	flag.Parse()
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintf(os.Stderr, "listen: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%s\n", l.Addr())
	os.Stdout.Sync()
	pubsub.NewBroker(&pubsub.BrokerConfig{AuthenticationKey: *authkey}).Serve(l)
}
