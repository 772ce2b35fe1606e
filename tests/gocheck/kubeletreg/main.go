// Command kubeletreg calls a plugin's registration socket the way the kubelet's plugin manager does
// (k8s.io/kubernetes pkg/kubelet/pluginmanager/operationexecutor): one gRPC connection over the unix
// socket (grpc-go, the kubelet's HTTP/2 and HPACK), GetInfo with the kubelet's one-second deadline,
// then NotifyRegistrationStatus on the same connection. It judges nothing itself: it prints, as
// JSON on stdout, what each GetInfo answered and each call's error, and tests/test_registration.py
// compares that with what the agent promises.
//
// Usage: kubeletreg SOCKET CALLS [REJECTION]
//
// CALLS GetInfo + NotifyRegistrationStatus rounds on the one connection; with REJECTION, each
// notification says the kubelet rejected the plugin with that message.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type round struct {
	Type              string   `json:"type"`
	Name              string   `json:"name"`
	Endpoint          string   `json:"endpoint"`
	SupportedVersions []string `json:"supportedVersions"`
	InfoError         string   `json:"infoError"`
	NotifyError       string   `json:"notifyError"`
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: kubeletreg SOCKET CALLS [REJECTION]")
		os.Exit(2)
	}
	calls, err := strconv.Atoi(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	conn, err := grpc.NewClient("unix://"+os.Args[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close()
	client := registerapi.NewRegistrationClient(conn)
	rounds := []round{}
	for i := 0; i < calls; i++ {
		var r round
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		info, err := client.GetInfo(ctx, &registerapi.InfoRequest{})
		cancel()
		if err != nil {
			r.InfoError = err.Error()
		} else {
			r.Type, r.Name, r.Endpoint, r.SupportedVersions = info.Type, info.Name, info.Endpoint, info.SupportedVersions
		}
		status := &registerapi.RegistrationStatus{PluginRegistered: true}
		if len(os.Args) > 3 {
			status = &registerapi.RegistrationStatus{PluginRegistered: false, Error: os.Args[3]}
		}
		ctx, cancel = context.WithTimeout(context.Background(), time.Second)
		if _, err := client.NotifyRegistrationStatus(ctx, status); err != nil {
			r.NotifyError = err.Error()
		}
		cancel()
		rounds = append(rounds, r)
	}
	if err := json.NewEncoder(os.Stdout).Encode(rounds); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
